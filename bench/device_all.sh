#!/bin/bash
# One device call for both open device checks (issues 29 and 30), about 7 minutes on an H100/H200
# machine with 16 cores: bench/device_gpu_kvcopy.sh (the connector's copies at 8K and 32K
# tokens, ~2 minutes), then bench/device_data_threads.sh's parts "tls" (sealed records vs
# plain, data threads off and on), "bare" (the bare threaded floor) and "workers" (data worker
# processes: 0 / 4 / 8 per daemon, plain and sealed). Prepare .devwheels here first
# (`bash bench/device_wheels.sh`: the xdc wheel of the commit you measure and what the device
# lacks), then:
#   run: `bash bench/device_all.sh`, carry [".devwheels"], timeout_s 590
# Results: $OUT/gpu (log.txt, gpu_kvcopy.json) and $OUT/dt (log.txt, tls.json,
# workers_plain.json, workers_sealed.json): six files, within what a call brings back. The
# other parts need a call of their own; the next most telling, about 3 minutes:
#   run: `PARTS="procs chunks profile" bash bench/device_data_threads.sh`, carry [".devwheels"]
# (iperf3 as one process per core; 2 vs 4 MiB chunks with data threads, which says whether the
# event loop's per-chunk work caps plain TCP; py-spy of the daemons with data threads on).
set -u
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/xdc-device-out}
mkdir -p "$O/gpu" "$O/dt"
OUT=$O/gpu timeout 200 bash bench/device_gpu_kvcopy.sh
echo "gpu part rc=$?"
OUT=$O/dt PARTS="tls bare workers" TLS_REPEATS=2 TLS_TIMEOUT=150 timeout 340 \
  bash bench/device_data_threads.sh
echo "data-plane part rc=$?"
