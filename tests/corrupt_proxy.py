"""A tiny TCP proxy of our own that flips one byte in flight: toxiproxy cannot corrupt data,
and the point is to prove the receiver's checksum catches what TCP's weak checksum lets by."""

from __future__ import annotations

import contextlib
import socket
import threading


class CorruptingProxy:
    def __init__(self, upstream_port: int, flip_at: int) -> None:
        self.upstream_port = upstream_port
        self.flip_at = flip_at  # byte offset in the first connection's client->server stream
        self.flipped = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._conns = 0
        self._stop = False
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._socks += [client, upstream]
            first = self._conns == 0
            self._conns += 1
            threading.Thread(target=self._pump, args=(client, upstream, first), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, corrupt: bool) -> None:
        seen = 0
        try:
            while data := src.recv(65536):
                if corrupt and seen <= self.flip_at < seen + len(data):
                    buf = bytearray(data)
                    buf[self.flip_at - seen] ^= 0xFF
                    data = bytes(buf)
                    self.flipped.set()
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop = True
        self.listener.close()
        for s in self._socks:
            s.close()
