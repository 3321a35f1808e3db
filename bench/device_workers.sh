#!/bin/bash
# Issue 30 on the device machine (16 cores), about 8 minutes: data worker processes per daemon
# against none, plain TCP and sealed records, beside the bare threaded floor and iperf3 as one
# process per core, all in one run; receiver runs off and on (step 2, receiver.worker_runs),
# plain and sealed; the ratio (sealed against plain, both with 8 workers and runs,
# interleaved: bench/tls.py); and where the time goes with 8 workers and runs (py-spy
# following the workers too).
# Re-measures what 2026-11-30's run measured before 27c84ee: until then connections that came
# up together were all handed to one worker (status "per_worker" says how they are spread).
#   run: `bash bench/device_workers.sh`, carry [".devwheels"] (bash bench/device_wheels.sh first)
#   SKIP_PROCS=1: no iperf3-per-core reference; SKIP_PROFILE=1: no py-spy part
set -u
export PYTHONUNBUFFERED=1
REPO=$(pwd)
O=${OUT:-/tmp/xdc-device-out}
mkdir -p "$O"
parts="bare"
[ "${SKIP_PROCS:-}" ] || parts="bare procs"
OUT=$O PARTS="$parts" timeout 200 bash bench/device_data_threads.sh
echo "reference parts ($parts) rc=$? (1 when the last part is not selected: harmless)"
exec > >(tee "$O/workers_log.txt") 2>&1
export PATH=/tmp/ip3/usr/bin:$PATH LD_LIBRARY_PATH=/tmp/ip3/usr/lib/x86_64-linux-gnu
cd /tmp
for mode in plain sealed; do
  tls=""; [ "$mode" = sealed ] && tls="--tls sealed"
  # shellcheck disable=SC2086
  timeout 150 python3 "$REPO"/bench/knob_ab.py sender.data_workers+receiver.data_workers 0,8 \
    --repeats 3 $tls --json-out "$O/workers_$mode.json" | tail -4
  echo "workers $mode rc=$?"
done
# step 2 (receiver.worker_runs): the receiver's workers land first sends without a job each;
# 8 workers per daemon, plain TCP, 512 MiB requests (a run holds the requests that had begun
# when it started), interleaved, 3 repeats
XDC_SENDER__DATA_WORKERS=8 XDC_RECEIVER__DATA_WORKERS=8 timeout 150 python3 \
  "$REPO"/bench/knob_ab.py receiver.worker_runs false,true --repeats 3 --request-mib 512 \
  --json-out "$O/worker_runs_plain.json" | tail -4
echo "worker runs rc=$?"
# the same with sealed records (runs read them too since afdb8c4)
XDC_SENDER__DATA_WORKERS=8 XDC_RECEIVER__DATA_WORKERS=8 timeout 150 python3 \
  "$REPO"/bench/knob_ab.py receiver.worker_runs false,true --repeats 3 --request-mib 512 \
  --tls sealed --json-out "$O/worker_runs_sealed.json" | tail -4
echo "worker runs sealed rc=$?"
# the goal: sealed records >= 0.9x plain, CPU per GB <= 1.3x plain's; both with 8
# workers and runs, interleaved
XDC_SENDER__DATA_WORKERS=8 XDC_RECEIVER__DATA_WORKERS=8 XDC_RECEIVER__WORKER_RUNS=true \
  timeout 120 python3 "$REPO"/bench/tls.py --repeats 3 --rates "" --record-layers sealed \
  --request-mib 512 --json-out "$O/tls_workers_runs.json" | tail -6
echo "tls with workers and runs rc=$?"
[ "${SKIP_PROFILE:-}" ] && exit 0
XDC_SENDER__DATA_WORKERS=8 XDC_RECEIVER__DATA_WORKERS=8 XDC_RECEIVER__WORKER_RUNS=true \
  timeout 90 py-spy record -s -r 100 \
  -f raw -o "$O/wprofile.txt" -- python3 -m xdc bench transfer --rates "" --repeats 1 \
  --seconds 5 | tail -2
python3 "$REPO"/bench/profile_summary.py "$O/wprofile.txt" --top 30 > "$O/wprofile_summary.txt"
head -80 "$O/wprofile_summary.txt"
