#!/usr/bin/env bash
# Install everything the test suite needs on a fresh Debian machine (run as root):
# kernel tools for the WAN lab (iproute2 for netns/veth/tc tbf, iptables for random loss),
# iperf3 (the benchmark reference), redis-server (router replicas share state through it; the
# tests start their own), the real toxiproxy server built from its Go module, xdc itself
# with its test extras, and vLLM's CPU build in a venv of its own (deploy/install-vllm.sh).
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

# vLLM's venv is the longest step (~3 min, mostly downloads): it installs beside the rest.
# Its last part, xdc into the venv, waits for the end (two editable installs of one checkout
# at once would both write its metadata).
vllm_pid=""
vllm_log=""
if [ "${XDC_SKIP_VLLM:-0}" != 1 ]; then
  vllm_log=$(mktemp)
  XDC_VLLM_WITHOUT_XDC=1 bash deploy/install-vllm.sh >"$vllm_log" 2>&1 &
  vllm_pid=$!
fi

need_apt=()
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v iptables >/dev/null 2>&1 || need_apt+=(iptables)
command -v iperf3 >/dev/null 2>&1 || need_apt+=(iperf3)
# the router-replica tests start their own redis-server (random port, temp dir)
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

TOXIPROXY_VERSION=v2.12.0
if ! command -v toxiproxy-server >/dev/null 2>&1; then
  if command -v go >/dev/null 2>&1 || [ -x /usr/local/go/bin/go ]; then
    GO=$(command -v go || echo /usr/local/go/bin/go)
    echo "setup: building toxiproxy-server ${TOXIPROXY_VERSION} from its Go module"
    tmp=$(mktemp -d)
    GOBIN="$tmp" "$GO" install "github.com/Shopify/toxiproxy/v2/cmd/server@${TOXIPROXY_VERSION}"
    install -m 0755 "$tmp/server" /usr/local/bin/toxiproxy-server
    rm -rf "$tmp"
  else
    echo "setup: no Go toolchain; toxiproxy tests will skip"
  fi
fi

# pyverbs (rdma-core's python3-pyverbs) keeps the RDMA backend honest without a device: the
# tests build every verbs object the backend builds with the real library. Debian ships it
# for its own python3; it is linked in (alone, not all of dist-packages) only when that build
# matches this interpreter's extension ABI. Without it those tests skip and say why.
if ! python3 -c 'import pyverbs' >/dev/null 2>&1; then
  deb=/usr/lib/python3/dist-packages/pyverbs
  if [ ! -d "$deb" ]; then
    echo "setup: apt-get install python3-pyverbs"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq python3-pyverbs >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq python3-pyverbs >/dev/null 2>&1; } \
      || echo "setup: python3-pyverbs not installable; pyverbs tests will skip"
  fi
  suffix=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  if [ -e "$deb/base$suffix" ]; then
    mkdir -p /usr/local/lib/xdc-pyverbs
    ln -sfn "$deb" /usr/local/lib/xdc-pyverbs/pyverbs
    site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo /usr/local/lib/xdc-pyverbs > "$site/xdc-pyverbs.pth"
    python3 -c 'import pyverbs.device' && echo "setup: pyverbs linked from $deb"
  else
    echo "setup: no pyverbs build for this interpreter ($suffix); pyverbs tests will skip"
  fi
fi

python3 -m pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | grep -v "running pip as the 'root' user" || true
python3 -c "import xdc, xdc.transport, trio, aiohttp, msgpack, numpy, xxhash, orjson, redis, zmq"

# vLLM's CPU build in its own venv, for the tests that run real engines (the KV connector,
# the router's vLLM KV events); XDC_SKIP_VLLM=1 leaves it out (those tests then skip)
if [ -n "$vllm_pid" ]; then
  if ! wait "$vllm_pid"; then
    cat "$vllm_log"
    echo "setup: installing vLLM failed" >&2
    exit 1
  fi
  cat "$vllm_log"
  rm -f "$vllm_log"
  bash deploy/install-vllm.sh  # the venv is there: this puts xdc into it
fi
echo "setup: ok"
