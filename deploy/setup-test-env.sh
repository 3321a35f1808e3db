#!/usr/bin/env bash
# Install everything the test suite needs on a fresh Debian machine (run as root):
# kernel tools for the WAN lab (iproute2 for netns/veth/tc tbf, iptables for random loss),
# iperf3 (the benchmark reference), the real toxiproxy server built from its Go module,
# and xdc itself with its test extras. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v iptables >/dev/null 2>&1 || need_apt+=(iptables)
command -v iperf3 >/dev/null 2>&1 || need_apt+=(iperf3)
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

python3 -m pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | grep -v "running pip as the 'root' user" || true
python3 -c "import xdc, xdc.transport, trio, aiohttp, msgpack, numpy, xxhash" 
echo "setup: ok"
