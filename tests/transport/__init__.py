"""The daemons: engine API, peers, TLS, faults, resource limits, shutdown, data threads."""
