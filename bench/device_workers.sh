#!/bin/bash
# Issue 30 follow-up on the device machine (16 cores), about 4 minutes: the reference that uses
# the cores (iperf3 as one process per core, bench/device_data_threads.sh's "procs" part), data
# worker processes with 16 connections (0 / 8 / 16 per daemon, plain), and where the time goes
# with 8 workers per daemon (py-spy following the worker processes too, all samples).
#   run: `bash bench/device_workers.sh`, carry [".devwheels"] (bash bench/device_wheels.sh first)
set -u
export PYTHONUNBUFFERED=1
REPO=$(pwd)
O=${OUT:-/tmp/xdc-device-out}
mkdir -p "$O"
[ "${SKIP_PROCS:-}" ] && PARTS_=none || PARTS_=procs
OUT=$O PARTS="$PARTS_" timeout 150 bash bench/device_data_threads.sh
echo "procs part rc=$?"
exec > >(tee "$O/workers_log.txt") 2>&1
export PATH=/tmp/ip3/usr/bin:$PATH LD_LIBRARY_PATH=/tmp/ip3/usr/lib/x86_64-linux-gnu
cd /tmp
[ "${SKIP_KNOB:-}" ] || timeout 150 python3 "$REPO"/bench/knob_ab.py sender.data_workers+receiver.data_workers 0,8,16 \
  --connections 16 --repeats 2 --json-out "$O/workers16_plain.json" | tail -5
echo "workers x16 connections rc=$?"
XDC_SENDER__DATA_WORKERS=8 XDC_RECEIVER__DATA_WORKERS=8 timeout 90 py-spy record -s -r 100 \
  -f raw -o "$O/wprofile.txt" -- python3 -m xdc bench transfer --rates "" --repeats 1 \
  --seconds 5 | tail -2
python3 "$REPO"/bench/profile_summary.py "$O/wprofile.txt" --top 30 > "$O/wprofile_summary.txt"
head -80 "$O/wprofile_summary.txt"
