"""Sans-IO wire protocol: bytes in, events out; events in, bytes out."""
