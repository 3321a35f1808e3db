#!/usr/bin/env bash
# The whole suite in two runs of pytest (arguments go to both): the tests that start no vLLM
# engine on XDC_TEST_WORKERS workers (default 2; they mostly wait on sockets, timers and child
# processes: on 2 cores their wall time halves, 878 s to 450 s), then the `vllm` tests one at a
# time (their engines are pinned to cores 0 and 1, and two at once would miss deadlines).
# Both always run; the exit status is the first failure's (a run that selects no test, as
# `run-tests.sh tests/protocol` makes the second, is not one, unless neither selects any).
set -uo pipefail
cd "$(dirname "$0")/.."
workers=${XDC_TEST_WORKERS:-2}
case "$workers" in
  '' | *[!0-9]*) echo "run-tests: XDC_TEST_WORKERS must be a whole number, not '$workers'" >&2; exit 2 ;;
esac
parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers")
echo "run-tests: 1/2: tests without vLLM engines, ${workers} worker(s)"
python3 -m pytest -q "${parallel[@]}" -m "not vllm" "$@"
first=$?
echo "run-tests: 2/2: tests with vLLM engines, one at a time"
python3 -m pytest -q -p no:xdist -m vllm "$@"
second=$?
if [ "$first" -eq 5 ] && [ "$second" -eq 5 ]; then exit 5; fi
[ "$first" -eq 5 ] && first=0
[ "$second" -eq 5 ] && second=0
[ "$first" -ne 0 ] && exit "$first"
exit "$second"
