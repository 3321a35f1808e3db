"""The wire protocol between the daemons, sans-IO: frames and events, the connection state
machine that turns bytes into events and back, chunk checksums and the hard limits both
peers enforce (docs/protocol.md)."""
