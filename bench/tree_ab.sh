#!/usr/bin/env bash
# Two commits of xdc side by side: `xdc bench transfer` on loopback, the trees interleaved in
# one run (A then B, then B then A, ...), so the VM's drift hits both alike. Each tree is
# installed into its own directory and imported from there (a sitecustomize drops the editable
# checkout's import hook); the daemons the bench starts inherit it.
#
#   bash bench/tree_ab.sh REF_A REF_B [REPEATS] [CHUNK_KIBS] [DATA_THREADS] > out.jsonl
#   e.g. bash bench/tree_ab.sh HEAD~1 HEAD 3 "64 2048" "off on"
#   WORKERS=N: N data worker processes per daemon in every run (default 0)
#   REQUEST_MIB=M: requests of M MiB (default: xdc bench transfer's)
#   Other XDC_* settings in the environment reach both trees' daemons alike
#   (e.g. XDC_RECEIVER__WORKER_RUNS=true)
#
# One JSON line per run: tree, ref, data_threads, chunk_kib, repeat, goodput, iperf3 beside it,
# ratio, daemon CPU s/GB, failed requests. Summarise with bench/tree_ab_summary.py.
set -euo pipefail
A=${1:?ref A}
B=${2:?ref B}
REPEATS=${3:-3}
CHUNKS=${4:-2048}
THREADS=${5:-off}
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d /tmp/xdc-tree-ab.XXXXXX)
trap 'git -C "$REPO" worktree remove --force "$WORK/src-a" >/dev/null 2>&1 || true;
      git -C "$REPO" worktree remove --force "$WORK/src-b" >/dev/null 2>&1 || true;
      rm -rf "$WORK"' EXIT

install_tree() {  # ref name
  git -C "$REPO" worktree add -q --detach "$WORK/src-$2" "$1"
  python3 -m pip install -q --no-deps --target "$WORK/site-$2" "$WORK/src-$2" >&2 2>/dev/null
  cat > "$WORK/site-$2/sitecustomize.py" <<'EOF'
"""bench/tree_ab.sh: import xdc from this directory, not from the editable checkout."""
import sys

sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f)]
EOF
}
install_tree "$A" a
install_tree "$B" b

cd "$WORK"  # not the checkout: '' on sys.path would find its xdc/ first
for rep in $(seq 1 "$REPEATS"); do
  for threads in $THREADS; do
    for chunk in $CHUNKS; do
      if (( rep % 2 )); then order="a b"; else order="b a"; fi
      for t in $order; do
        ref=$([ "$t" = a ] && echo "$A" || echo "$B")
        j="$WORK/run.json"
        rm -f "$j"
        # the worker settings only where asked for: a tree older than them refuses the field
        workers=()
        [ "${WORKERS:-0}" != 0 ] && workers=(XDC_SENDER__DATA_WORKERS="$WORKERS"
          XDC_RECEIVER__DATA_WORKERS="$WORKERS")
        env PYTHONPATH="$WORK/site-$t" XDC_SENDER__DATA_THREADS="$threads" \
          XDC_RECEIVER__DATA_THREADS="$threads" "${workers[@]}" timeout 300 python3 -m xdc bench transfer \
          --rates "" --repeats 1 --seconds 5 --chunk-kib "$chunk" ${REQUEST_MIB:+--request-mib "$REQUEST_MIB"} \
          --json-out "$j" >&2 || true
        python3 - "$j" "$t" "$ref" "$threads" "$chunk" "$rep" "${WORKERS:-0}" <<'PY'
import json
import sys

path, tree, ref, threads, chunk, rep, workers = sys.argv[1:]
row = {"tree": tree, "ref": ref, "data_threads": threads, "chunk_kib": int(chunk),
       "repeat": int(rep), "data_workers": int(workers)}
try:
    link = json.load(open(path))["links"][0]
except (OSError, ValueError, KeyError, IndexError) as e:
    row["error"] = f"no result: {e}"
else:
    row.update(xdc_gbps=link["xdc_gbps_median"], iperf3_gbps=link["iperf3_gbps_median"],
               ratio=link["ratio_median"], cpu_s_per_gb=link["cpu_s_per_gb_median"],
               failed=link["failed_requests"])
    if link.get("loop_s_per_gb_median"):  # each daemon's event loop alone (trees since 27c84ee)
        row["loop_s_per_gb"] = link["loop_s_per_gb_median"]
print(json.dumps(row), flush=True)
PY
      done
    done
  done
done
