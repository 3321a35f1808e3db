#!/usr/bin/env bash
# Manual WAN lab: the same two-namespace setup xdc.lab.netlab.NetLab builds for tests.
#
#   lab.sh up [--rate GBIT] [--loss PROB]   create xdcl-a <-> xdcl-b (10.231.255.1 <-> .2)
#   lab.sh rate GBIT|off                    tbf on xdcl-a's egress (the sending side)
#   lab.sh loss PROB|off                    random drop of a->b packets in xdcl-b's INPUT
#   lab.sh status                           namespaces, addresses, qdiscs, drop rules
#   lab.sh down                             kill everything inside, delete both namespaces
#   lab.sh exec a|b CMD...                  run CMD inside a namespace
#
# Nothing touches the host namespace: the veth ends are created inside the lab namespaces,
# which have no default route. netem is not needed (tbf for rate, iptables statistic for
# loss; see xdc/lab/netlab.py for why loss is dropped on the receiver's INPUT, not on OUTPUT).
# Example:
#   sudo deploy/wan-lab/lab.sh up --rate 1 --loss 0.01
#   sudo deploy/wan-lab/lab.sh exec b python3 -m xdc.lab.link_load sink --host 10.231.255.2 --port 5201 &
#   sudo deploy/wan-lab/lab.sh exec a python3 -m xdc.lab.link_load blast --host 10.231.255.2 --port 5201
set -euo pipefail

NS_A=xdcl-a
NS_B=xdcl-b
DEV_A=xdc-veth-a
DEV_B=xdc-veth-b
ADDR_A=10.231.255.1
ADDR_B=10.231.255.2

die() { echo "lab.sh: $*" >&2; exit 1; }
need_root() { [ "$(id -u)" -eq 0 ] || die "needs root"; }
exists() { ip netns list | awk '{print $1}' | grep -qx "$1"; }

set_rate() {
  local gbit=$1
  if [ "$gbit" = off ]; then
    tc -n "$NS_A" qdisc del dev "$DEV_A" root 2>/dev/null || true
    return
  fi
  local bits burst
  bits=$(awk -v g="$gbit" 'BEGIN { printf "%d", g * 1e9 }')
  # burst must hold a 64 KiB GSO packet: max(256 KiB, 2 ms at the rate)
  burst=$(awk -v b="$bits" 'BEGIN { x = int(b / 8 / 500); printf "%d", (x > 262144 ? x : 262144) }')
  tc -n "$NS_A" qdisc replace dev "$DEV_A" root tbf rate "${bits}bit" burst "$burst" latency 10ms
}

LOSS_SPEC=(-i "$DEV_B" -s "$ADDR_A" -d "$ADDR_B" -m statistic --mode random)
set_loss() {
  local prob=$1
  # remove any previous drop rule (whatever its probability)
  while ip netns exec "$NS_B" iptables -w 5 -S INPUT | grep -q -- '-j DROP'; do
    ip netns exec "$NS_B" iptables -w 5 -D INPUT 1
  done
  [ "$prob" = off ] && return
  ip netns exec "$NS_B" iptables -w 5 -I INPUT "${LOSS_SPEC[@]}" --probability "$prob" -j DROP
}

up() {
  local rate="" loss=""
  while [ $# -gt 0 ]; do
    case $1 in
      --rate) rate=$2; shift 2 ;;
      --loss) loss=$2; shift 2 ;;
      *) die "up: unknown option $1" ;;
    esac
  done
  exists "$NS_A" && die "lab is already up (run: $0 down)"
  ip netns add "$NS_A"
  ip netns add "$NS_B"
  ip link add "$DEV_A" netns "$NS_A" type veth peer name "$DEV_B" netns "$NS_B"
  ip -n "$NS_A" addr add "$ADDR_A/30" dev "$DEV_A"
  ip -n "$NS_B" addr add "$ADDR_B/30" dev "$DEV_B"
  for ns in "$NS_A" "$NS_B"; do ip -n "$ns" link set lo up; done
  ip -n "$NS_A" link set "$DEV_A" up
  ip -n "$NS_B" link set "$DEV_B" up
  [ -n "$rate" ] && set_rate "$rate"
  [ -n "$loss" ] && set_loss "$loss"
  status
}

down() {
  for ns in "$NS_A" "$NS_B"; do
    exists "$ns" || continue
    for pid in $(ip netns pids "$ns"); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns"
  done
  echo "lab down"
}

status() {
  for ns in "$NS_A" "$NS_B"; do
    if ! exists "$ns"; then echo "$ns: absent"; continue; fi
    echo "== $ns"
    ip -n "$ns" -br addr show
    tc -n "$ns" qdisc show | grep -v noqueue || true
    ip netns exec "$ns" iptables -S | grep -- '-j DROP' || true
    echo "processes: $(ip netns pids "$ns" | wc -l)"
  done
}

cmd=${1:-status}
shift || true
case $cmd in
  up) need_root; up "$@" ;;
  down) need_root; down ;;
  status) status ;;
  rate) need_root; exists "$NS_A" || die "lab is down"; set_rate "${1:?GBIT or off}"; status ;;
  loss) need_root; exists "$NS_B" || die "lab is down"; set_loss "${1:?PROB or off}"; status ;;
  exec) need_root; side=${1:?a or b}; shift
        case $side in a) ns=$NS_A ;; b) ns=$NS_B ;; *) die "exec: a or b" ;; esac
        exec ip netns exec "$ns" "$@" ;;
  *) die "usage: $0 up [--rate GBIT] [--loss PROB] | rate GBIT|off | loss PROB|off | status | down | exec a|b CMD" ;;
esac
