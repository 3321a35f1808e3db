"""The congestion monitor and the network lab: tcp_info, /proc/net, pacing, link reports to the
router."""
