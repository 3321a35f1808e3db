#!/bin/bash
# Data threads off/on on a many-core machine with no package index (the device machine):
# interleaved `xdc bench transfer` runs on loopback with iperf3 in each, then TLS vs plain with
# data threads off and on (bench/tls.py; sealed records take the threads; AES-GCM and AEGIS-128L),
# record sealing in N threads (bench/aead_threads.py, bench/sealed_threads.py), the bare threaded floor (bench/bare_tcp.py) and iperf3 as one process
# per core. Results under $OUT.
#
# Prepare, on a machine with an index, a folder the run carries (git-ignored):
#   mkdir -p .devwheels && echo /.devwheels/ >> .git/info/exclude
#   pip wheel --no-deps -w .devwheels .
#   (cd .devwheels && pip download --no-deps --only-binary=:all: --python-version 3.12 \
#      --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 \
#      --platform manylinux_2_17_x86_64 --platform manylinux_2_34_x86_64 trio outcome sniffio \
#      orjson cryptography cffi pycparser pynacl trustme py-spy && \
#    apt-get download iperf3 libiperf0 libsctp1)
# then run `bash bench/device_data_threads.sh` there with .devwheels carried.
#
# All of it takes about 9 minutes on 16 cores, close to one command's 10-minute limit: run it in
# two calls, e.g. PARTS="transfer tls aead" then PARTS="batch inproc bare procs chunks profile"
# (PARTS unset or "all": every part). TLS_REPEATS / TLS_TIMEOUT shorten the TLS part.
set -u
want() { [[ " ${PARTS:-all} " == *" all "* || " ${PARTS:-all} " == *" $1 "* ]]; }
REPO=$(pwd)
OUT=${OUT:-/tmp/xdc-device-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
echo "cores $(nproc)"; uname -r; grep -m1 'model name' /proc/cpuinfo
python3 -m pip install -q --no-index --no-deps --force-reinstall "$REPO"/.devwheels/*.whl
mkdir -p /tmp/ip3 && for f in "$REPO"/.devwheels/*.deb; do dpkg -x "$f" /tmp/ip3; done
export PATH=/tmp/ip3/usr/bin:$PATH LD_LIBRARY_PATH=/tmp/ip3/usr/lib/x86_64-linux-gnu
cd /tmp  # not the checkout: `python3 -m xdc` must import the installed package
if want transfer; then
for r in 1 2 3; do
  for m in off on; do
    echo "== repeat $r data_threads=$m"
    XDC_SENDER__DATA_THREADS=$m XDC_RECEIVER__DATA_THREADS=$m timeout 90 python3 -m xdc bench \
      transfer --rates "" --repeats 1 --seconds 5 --json-out "/tmp/t_${m}_$r.json" | grep "repeat 1"
  done
done
python3 - <<'PY' > "$OUT/ab.json"
import glob, json, statistics as st
out = {}
for m in ("off", "on"):
    runs = [json.load(open(f))["links"][0] for f in sorted(glob.glob(f"/tmp/t_{m}_*.json"))]
    keys = {"xdc_gbps": "xdc_gbps_median", "iperf3_gbps": "iperf3_gbps_median",
            "ratio": "ratio_median", "cpu_s_per_gb": "cpu_s_per_gb_median"}
    out[m] = {k: [r[v] for r in runs] for k, v in keys.items()}
    out[m]["failed"] = sum(r["failed_requests"] for r in runs)
    out[m]["median"] = {k: st.median(out[m][k]) for k in keys}
print(json.dumps(out, indent=1))
PY
cat "$OUT/ab.json"
fi
# sealed records in data threads (issue 30): each setting beside plain TCP in the same run,
# AES-GCM (holds the GIL) and AEGIS-128L (releases it)
want tls && timeout "${TLS_TIMEOUT:-420}" python3 "$REPO"/bench/tls.py --repeats "${TLS_REPEATS:-3}" --rates "" \
  --record-layers sealed/aes-128-gcm,sealed/aegis-128l --data-threads off,on \
  --json-out "$OUT/tls.json"
# does sealing in N threads use N cores? cryptography's AES-GCM (holds the GIL) vs libcrypto's
# through ctypes vs AEGIS-128L through PyNaCl's cffi
want aead && timeout 120 python3 "$REPO"/bench/aead_threads.py --json "$OUT/aead_threads.json" | tail -1
# chunks per thread hand-off on the sender, with data threads on (1 = before batching)
want batch && XDC_SENDER__DATA_THREADS=on XDC_RECEIVER__DATA_THREADS=on timeout 150 python3 \
  "$REPO"/bench/knob_ab.py sender.send_batch_chunks 1,4 --repeats 3 --json-out "$OUT/batch.json" \
  | tail -4
# the same threads with both ends in one process (one GIL): 8 connections, 16 threads
want inproc && timeout 90 python3 "$REPO"/bench/sealed_threads.py --connections 8 --seconds 3 --repeats 3 \
  --json "$OUT/sealed_threads.json"
want bare && for r in 1 2; do
  timeout 30 python3 "$REPO"/bench/bare_tcp.py rx 127.0.0.1 $((7600 + r)) 8 2048 >/dev/null &
  rx=$!
  sleep 1.5
  timeout 30 python3 "$REPO"/bench/bare_tcp.py tx 127.0.0.1 $((7600 + r)) 8 2048 5 | tail -1
  wait "$rx"  # not a bare `wait`: that would also wait for the tee above
done
# the reference that uses the cores too (issue 30): iperf3 as one process per core, the
# connections split among them, summed; beside xdc on the same 16 connections
procs=$(nproc); [ "$procs" -gt 16 ] && procs=16
want procs && timeout 120 python3 -m xdc bench transfer --rates "" --repeats 2 --seconds 5 --connections 16 \
  --iperf3-procs "$procs" --json-out "$OUT/iperf3_procs.json" | tail -3
# per-chunk work on the event loop (issue 30): plain TCP with data threads, 2 MiB vs 4 MiB
# chunks (8 MiB layers, so a layer holds either), interleaved: if the bigger chunks move
# clearly more, each chunk's bookkeeping on the event loop is what caps plain TCP there
want chunks && for r in 1 2; do
  for c in 2048 4096; do
    XDC_SENDER__DATA_THREADS=on XDC_RECEIVER__DATA_THREADS=on timeout 60 python3 -m xdc bench \
      transfer --rates "" --repeats 1 --seconds 5 --layers 8 --chunk-kib "$c" \
      --json-out "$OUT/chunks_${c}_$r.json" 2>&1 | grep "repeat 1" | sed "s/^/chunk $c KiB: /"
  done
done
# where the daemons' time goes with data threads on (issue 30): py-spy following the daemons the
# bench starts, all samples, then only those holding the GIL (what caps threads); summaries
want profile && for g in all gil; do
  flag=""; [ "$g" = gil ] && flag="-g"
  XDC_SENDER__DATA_THREADS=on XDC_RECEIVER__DATA_THREADS=on timeout 120 py-spy record -s $flag \
    -r 100 -f raw -o "$OUT/profile_$g.txt" -- python3 -m xdc bench transfer --rates "" \
    --repeats 1 --seconds 5 | tail -2
  python3 "$REPO"/bench/profile_summary.py "$OUT/profile_$g.txt" --top 25 \
    > "$OUT/profile_${g}_summary.txt"
  head -60 "$OUT/profile_${g}_summary.txt"
done
# the same for sealed records with data threads on (on 16 cores they ran at 0.37x plain, slower
# than with threads off: which frames hold the GIL), AES-GCM then AEGIS-128L
want sprofile && for c in aes-128-gcm aegis-128l; do
  timeout 100 py-spy record -s -g -r 100 -f raw -o "$OUT/sprofile_$c.txt" -- python3 \
    "$REPO"/bench/tls.py --repeats 1 --rates "" --record-layers "sealed/$c" --data-threads on \
    | tail -3
  python3 "$REPO"/bench/profile_summary.py "$OUT/sprofile_$c.txt" --top 25 \
    > "$OUT/sprofile_${c}_summary.txt"
  head -70 "$OUT/sprofile_${c}_summary.txt"
done
# data worker processes (issue 30, docs/data_workers.md): none / 4 / 8 per daemon, plain TCP
# and sealed records, each beside the others in the same run (threads at auto: plain on)
want workers && timeout 200 python3 "$REPO"/bench/knob_ab.py \
  sender.data_workers+receiver.data_workers 0,4,8 --repeats 2 --json-out "$OUT/workers_plain.json" \
  | tail -5
want workers && timeout 200 python3 "$REPO"/bench/knob_ab.py \
  sender.data_workers+receiver.data_workers 0,4,8 --repeats 2 --tls sealed \
  --json-out "$OUT/workers_sealed.json" | tail -5
