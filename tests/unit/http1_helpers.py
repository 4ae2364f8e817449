"""What the unit tests of Pulse's two HTTP/1.1 stream clients (workers/protocol/http1.py: the gateway's worker
channel and the llama-server stream client) feed them: a chunked body built by hand, and a transport that only
records what the client asked of it (the bytes are given to `data_received` directly, cut where a test wants)."""
from __future__ import annotations


def chunked(parts: list[bytes]) -> bytes:
    """`parts` as the chunks of a chunked body, then the last chunk."""
    return b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in parts) + b"0\r\n\r\n"


class RecordingTransport:
    def __init__(self):
        self.closed = self.paused = False

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed

    def pause_reading(self):
        self.paused = True

    def resume_reading(self):
        self.paused = False


def feed_in_reads(protocol, raw: bytes, step: int) -> None:
    """`raw` to `protocol.data_received` as separate reads of `step` bytes (the last one shorter)."""
    for i in range(0, len(raw), step):
        protocol.data_received(raw[i:i + step])
