#!/usr/bin/env bash
# Mooncake's Transfer Engine (non-CUDA wheel) in its own venv, for bench/mooncake_peer.py only:
# xdc never imports it. Needs Debian's libibverbs1 (the wheel links it even for TCP).
set -euo pipefail
VENV="${XDC_MOONCAKE_VENV:-/opt/xdc-mooncake}"
VERSION="${XDC_MOONCAKE_VERSION:-0.3.13.post1}"
if ! ldconfig -p | grep -q libibverbs.so.1; then
    apt-get install -y -q libibverbs1 >/dev/null
fi
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --disable-pip-version-check \
    "mooncake-transfer-engine-non-cuda==$VERSION" numpy
"$VENV/bin/python" -c "from mooncake.engine import TransferEngine; TransferEngine()"
echo "Mooncake TE $VERSION in $VENV (XDC_MOONCAKE_PYTHON=$VENV/bin/python)"
