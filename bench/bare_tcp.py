"""The floor for any Python data path with xdc's integrity: blocking threads, one per
connection, nothing else. The sender encrypts nothing and schedules nothing: it hashes a
CHUNK_KIB chunk of a 256 MiB pool (xxh3, as xdc does) and ``sendmsg``s header + chunk; the
receiver lands it with ``recv_into(MSG_WAITALL)`` straight into its own 256 MiB pool, verifies the
hash and answers an 8-byte ack; a second thread per connection drains the acks. No protocol,
no resend, no engine, no event loop: what is left is what the kernel and the hash cost.

bench/mooncake_peer.py runs it next to xdc, iperf3 and Mooncake TE, so the table shows how
far xdc's own machinery is above that floor on the machine of the day.

    python bench/bare_tcp.py rx HOST PORT CONNECTIONS CHUNK_KIB           # prints "ready"
    python bench/bare_tcp.py tx HOST PORT CONNECTIONS CHUNK_KIB SECONDS   # "go", then JSON
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import struct
import sys
import threading
import time

import xxhash

MIB = 1 << 20
POOL = 256 * MIB
HEADER = struct.Struct("!QQQ")  # sequence, length, xxh3-64
ACK = struct.Struct("!Q")


def _recv_exact(sock: socket.socket, dest: memoryview) -> bool:
    got = 0
    while got < len(dest):
        n = sock.recv_into(dest[got:], len(dest) - got, socket.MSG_WAITALL)
        if n == 0:
            return False
        got += n
    return True


def receiver(host: str, port: int, connections: int, chunk: int) -> None:
    pool = memoryview(mmap.mmap(-1, POOL))
    share = POOL // connections // chunk * chunk
    listener = socket.create_server((host, port), backlog=connections)
    print("ready", flush=True)
    bad: list[str] = []

    def serve(conn: socket.socket, k: int) -> None:
        head = bytearray(HEADER.size)
        base, off = k * share, 0
        with conn:
            while _recv_exact(conn, memoryview(head)):
                seq, length, digest = HEADER.unpack(head)
                if length > chunk:
                    bad.append(f"connection {k}: chunk of {length} bytes")
                    return
                dest = pool[base + off : base + off + length]
                if not _recv_exact(conn, dest):
                    return
                if xxhash.xxh3_64_intdigest(dest) != digest:
                    bad.append(f"connection {k}: chunk {seq} failed its checksum")
                    return
                conn.sendall(ACK.pack(seq))
                off = (off + chunk) % share

    threads = []
    for k in range(connections):
        conn, _ = listener.accept()
        t = threading.Thread(target=serve, args=(conn, k))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    if bad:
        sys.exit("; ".join(bad))


def sender(host: str, port: int, connections: int, chunk: int, seconds: float) -> None:
    pool = mmap.mmap(-1, POOL)
    block = os.urandom(MIB)
    for off in range(0, POOL, MIB):
        pool[off : off + MIB] = block
    view = memoryview(pool)
    socks = [socket.create_connection((host, port), timeout=10) for _ in range(connections)]
    for s in socks:
        s.settimeout(None)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sent = [0] * connections
    stop_at = 0.0

    def drain_acks(s: socket.socket) -> None:
        buf = memoryview(bytearray(ACK.size))
        while _recv_exact(s, buf):
            pass

    def send(k: int) -> None:
        s = socks[k]
        acks = threading.Thread(target=drain_acks, args=(s,))
        acks.start()
        off, seq = k * chunk, 0
        while time.monotonic() < stop_at:
            data = view[off : off + chunk]
            s.sendmsg([HEADER.pack(seq, chunk, xxhash.xxh3_64_intdigest(data)), data])
            sent[k] += chunk
            seq += 1
            off = (off + connections * chunk) % (POOL // chunk * chunk)
        s.shutdown(socket.SHUT_WR)
        acks.join()
        s.close()

    threads = [threading.Thread(target=send, args=(k,)) for k in range(connections)]
    print("go", flush=True)
    t0 = time.monotonic()
    stop_at = t0 + seconds
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"bytes": sum(sent), "seconds": time.monotonic() - t0}), flush=True)


def main(argv: list[str]) -> None:
    if len(argv) != {"rx": 5, "tx": 6}.get(argv[0] if argv else "", -1):
        sys.exit(__doc__)
    role, host = argv[0], argv[1]
    try:
        port, n, chunk_kib = int(argv[2]), int(argv[3]), int(argv[4])
        seconds = float(argv[5]) if role == "tx" else 0.0
    except ValueError as e:
        sys.exit(f"bare_tcp: {e}")
    chunk = chunk_kib * 1024
    if not (0 < port < 65536 and 0 < n <= 64 and 0 < chunk <= POOL // n and 0 <= seconds <= 3600):
        sys.exit(
            f"bare_tcp: need 0 < port < 65536, 1-64 connections, 0 < chunk <= {POOL}/connections, "
            "0-3600 seconds"
        )
    if role == "rx":
        receiver(host, port, n, chunk)
    else:
        sender(host, port, n, chunk, seconds)


if __name__ == "__main__":
    main(sys.argv[1:])
