"""Parse throughput of the sans-IO receive path for 1 MiB chunks.

Measures what the receiver's CPU does per chunk besides the socket: append a read to the
connection's buffer, parse the prefix and msgpack header, and copy the payload into a numpy
destination with take_buffered_payload (plus, with --checksum, the xxh3 verify). Prints GB/s
of payload. Usage: python bench/protocol_parse.py [--chunks N] [--chunk-bytes B] [--read-bytes R]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from xdc.protocol import (
    NEED_DATA,
    PAYLOAD,
    PROTOCOL_VERSION,
    ChunkHeader,
    Connection,
    Hello,
    Limits,
    checksum,
    encode,
    encode_chunk_header,
)


def build_stream(chunks: int, chunk_bytes: int) -> tuple[bytes, bytes]:
    payload = np.random.default_rng(0).integers(0, 256, chunk_bytes, dtype=np.uint8).tobytes()
    hello = encode(Hello(PROTOCOL_VERSION, "bench", "sender", "s", 0))
    frames = []
    for i in range(chunks):
        hdr = ChunkHeader("bench-req", i % 64, (i // 64) * chunk_bytes, chunk_bytes, 12345)
        frames.append(encode_chunk_header(hdr) + payload)
    return hello, b"".join(frames)


def run(stream: bytes, hello: bytes, dest: np.ndarray, read_bytes: int, verify: bool) -> int:
    conn = Connection("receiver", Limits())
    conn.receive_data(hello)
    conn.next_event()
    conn.send(Hello(PROTOCOL_VERSION, "bench-r", "receiver", "s", 0))
    view = dest.data
    data = memoryview(stream)
    pos = got = chunks = 0
    length = 0
    while True:
        ev = conn.next_event()
        if isinstance(ev, ChunkHeader):
            length = ev.length
            got = 0
            continue
        if ev is PAYLOAD:
            got += conn.take_buffered_payload(view[got:length])
            if got == length:
                if verify:
                    checksum(view[:length])
                chunks += 1
                continue
            # else: the buffer is drained, read more
        elif ev is not NEED_DATA:
            raise AssertionError(ev)
        if pos >= len(data):
            return chunks
        conn.receive_data(data[pos : pos + read_bytes])
        pos += read_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=512)
    ap.add_argument("--chunk-bytes", type=int, default=1 << 20)
    ap.add_argument("--read-bytes", type=int, default=1 << 20, help="size of each fed read")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--checksum", action="store_true", help="also verify xxh3 per chunk")
    args = ap.parse_args()
    hello, stream = build_stream(args.chunks, args.chunk_bytes)
    dest = np.empty(args.chunk_bytes, dtype=np.uint8)
    payload_bytes = args.chunks * args.chunk_bytes
    best = float("inf")
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        n = run(stream, hello, dest, args.read_bytes, args.checksum)
        best = min(best, time.perf_counter() - t0)
        assert n == args.chunks, n
    print(
        f"{args.chunks} x {args.chunk_bytes} B chunks, reads of {args.read_bytes} B, "
        f"checksum={'on' if args.checksum else 'off'}: "
        f"{payload_bytes / best / 1e9:.2f} GB/s ({best / args.chunks * 1e6:.1f} us/chunk, best of "
        f"{args.repeat})"
    )


if __name__ == "__main__":
    main()
