#!/usr/bin/env bash
# The whole suite in two runs of pytest (arguments go to both): first, on XDC_TEST_WORKERS
# workers (default 3), the tests that start no vLLM engine and assert no tight time bound;
# they mostly wait on sockets, timers and child processes (on 2 cores the tests without vLLM
# took 878 s serially and 450 s on two workers; on 2026-12-01's slower VM 601-636 s on two
# and 557 s on three, where CI as a whole had come to 44 of its 45 minutes). Then, one at a
# time, the `vllm` tests (their engines are pinned to cores 0 and 1, and two at once would
# miss deadlines) and the `serial`
# ones (a rate or a duration asserted within a tight bound: a CI run on two workers saw a
# 1 Gbit/s transfer take 0.68 s against a 0.60 s bound).
# Both always run; the exit status is the first failure's (a run that selects no test, as
# `run-tests.sh tests/protocol` makes the second, is not one, unless neither selects any).
set -uo pipefail
cd "$(dirname "$0")/.."
workers=${XDC_TEST_WORKERS:-3}
case "$workers" in
  '' | *[!0-9]*) echo "run-tests: XDC_TEST_WORKERS must be a whole number, not '$workers'" >&2; exit 2 ;;
esac
# more than 4 per core only queues them behind each other, and every one starts daemons and
# servers of its own: a typo (200 for 2) would fork hundreds of them
cores=$(nproc)
if [ "${#workers}" -gt 6 ] || [ "$workers" -gt $((4 * cores)) ]; then
  echo "run-tests: XDC_TEST_WORKERS=$workers is more than 4 per core (${cores} cores here: at most $((4 * cores)))" >&2
  exit 2
fi
parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers")
echo "run-tests: 1/2: tests without vLLM engines or tight time bounds, ${workers} worker(s)"
python3 -m pytest -q "${parallel[@]}" -m "not vllm and not serial" "$@"
first=$?
echo "run-tests: 2/2: tests with vLLM engines or tight time bounds, one at a time"
python3 -m pytest -q -p no:xdist -m "vllm or serial" "$@"
second=$?
if [ "$first" -eq 5 ] && [ "$second" -eq 5 ]; then exit 5; fi
[ "$first" -eq 5 ] && first=0
[ "$second" -eq 5 ] && second=0
[ "$first" -ne 0 ] && exit "$first"
exit "$second"
