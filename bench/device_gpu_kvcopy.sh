#!/bin/bash
# Issue 29's table on a one-GPU machine with torch and no package index (the device machine):
# bench/gpu_kvcopy.py at 8K and 32K tokens, old copies vs the new copier, plus the CUDA round
# trip. Needs torch with CUDA and numpy there; if numpy is missing, carry a wheel:
#   mkdir -p .devwheels && echo /.devwheels/ >> .git/info/exclude
#   (cd .devwheels && pip download --no-deps --only-binary=:all: --python-version 3.12 \
#      --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 numpy)
# and run `bash bench/device_gpu_kvcopy.sh` with .devwheels carried. Results under $OUT.
set -u
REPO=$(pwd)
OUT=${OUT:-/tmp/xdc-device-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "cores $(nproc)"; uname -r
# xdc's imports beyond torch (cryptography, xxhash, ...): the wheels bench/device_wheels.sh
# put in .devwheels (a run on 2026-11-30 stopped here when they were not installed yet)
if ! python3 -c "import numpy, cryptography, xxhash, trio" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps "$REPO"/.devwheels/*.whl
fi
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
timeout 420 python3 "$REPO/bench/gpu_kvcopy.py" --out "$OUT/gpu_kvcopy.json" --repeats "${REPEATS:-9}"
echo "rc=$?"
