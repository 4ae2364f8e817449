"""One streamed POST to llama-server on a connection of its own, parsed here (not by a general HTTP client).

The backend sends each generation on a new connection and closes it when done (closing it mid-stream makes
llama-server cancel the task), and reads the answer as SSE lines. aiohttp's client did work per request (a
ClientRequest, connector and timer objects, a task to await the headers) and per line (its stream reader,
an `asyncio.timeout` context) that this fixed exchange does not need; on the 2-core box that was ~1.2 ms of
the worker's CPU per 8-token request, on the path to the first token. Here one `data_received` call parses
what one read brought in (the chunked framing and every complete line) and wakes the reader once, and a
reader finds lines already in without a loop turn.

    stream = await open_stream("127.0.0.1", port, "/completion", body, connect_timeout_s=5)  # OSError
    while not await stream.head(timeout_s):  # False: no status line yet within timeout_s
        ...
    if stream.status != 200: body = await stream.body(timeout_s)
    line = await stream.line(idle_timeout_s)   # b"data: {...}" or b"error: ..."; TimeoutError; ConnectionError
    stream.close()                             # always; mid-stream it cancels the generation

Backpressure is kept: past HIGH_WATER bytes of unread lines the socket stops being read.
"""
from __future__ import annotations

import asyncio
import socket
from collections import deque

from workers.protocol.http1 import ResponseFraming

HIGH_WATER = 64 * 1024


class StreamClosed(ConnectionResetError):
    """The connection closed (by llama-server, by a crash, or by `close`) before the answer's end."""


class LlamaStream(ResponseFraming, asyncio.Protocol):
    """One request's connection and its answer, one-shot (`Connection: close`)."""

    peer = "llama-server"

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._reset_framing()
        self._lines_ready: deque[bytes] = deque()
        self._ready_bytes = 0
        self._paused = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None

    # ---- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.transport = None
        if self._mode == "eof" and exc is None:
            self._finish()
        elif self._mode != "done" and self._error is None:
            self._error = StreamClosed(f"llama-server closed the connection: {exc}" if exc else
                                       "llama-server closed the connection")
        self._wake()

    def data_received(self, data: bytes) -> None:
        try:
            self._feed(data)
        except ValueError as e:  # a malformed frame: end the stream with it
            self._error = StreamClosed(f"malformed answer from llama-server: {e}")
            if self.transport is not None:
                self.transport.close()
        if self._ready_bytes >= HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self):
        return None  # close: connection_lost ends an EOF-delimited body or reports the answer cut

    # ---- parsing (workers/protocol/http1.py) ---------------------------------------------------
    def _take_lines(self, block: bytes) -> None:
        for line in block.split(b"\n"):
            if line.startswith((b"data: ", b"error: ")):
                self._lines_ready.append(line)
                self._ready_bytes += len(line)

    def _last_line(self, line: bytes) -> None:
        if line.startswith((b"data: ", b"error: ")):
            self._lines_ready.append(line)

    # ---- the reader's side ---------------------------------------------------------------------
    async def _wait(self, timeout_s: float | None) -> bool:
        """Until something happens on the connection; False when `timeout_s` passed first."""
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(timeout_s, _expire, waiter) if timeout_s is not None else None
        try:
            return await waiter
        finally:
            if timer is not None:
                timer.cancel()
            self._waiter = None

    async def head(self, timeout_s: float | None) -> bool:
        """Whether the status line and headers are in (False: not within `timeout_s`); raises what cut the
        connection. This llama-server build sends them at once (older ones with the first token)."""
        while self._mode == "head":
            if self._error is not None:
                raise self._error
            if await self._wait(timeout_s) is False and self._mode == "head" and self._error is None:
                return False
        return True

    async def body(self, timeout_s: float | None) -> bytes:
        """The whole body of a non-200 answer."""
        while self._mode != "done":
            if self._error is not None:
                raise self._error
            if await self._wait(timeout_s) is False:
                raise TimeoutError("no complete error body from llama-server")
        return b"".join(self._body)

    async def line(self, idle_timeout_s: float | None) -> bytes:
        """The next `data: ` or `error: ` line (without its newline); b"" once the answer ended without
        one. TimeoutError: nothing arrived for `idle_timeout_s`; StreamClosed: the connection was cut."""
        while True:
            if self._lines_ready:
                line = self._lines_ready.popleft()
                self._ready_bytes -= len(line)
                if self._paused and self._ready_bytes < HIGH_WATER and self.transport is not None:
                    self._paused = False
                    self.transport.resume_reading()
                return line
            if self._mode == "done":
                return b""
            if self._error is not None:
                raise self._error
            if await self._wait(idle_timeout_s) is False:
                raise TimeoutError()

    def close(self) -> None:
        """Done with this answer (any number of times): closes the connection, and a reader still waiting
        on it gets StreamClosed."""
        if self._mode != "done" and self._error is None:
            self._error = StreamClosed("closed")
        if self.transport is not None:
            self.transport.close()
        self._wake()


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(False)


async def open_stream(host: str, port: int, path: str, body: bytes, *, connect_timeout_s: float,
                      headers: dict[str, str] | None = None) -> LlamaStream:
    """Connect and send `body` (JSON) as a POST to `path`, with `headers` besides the request's own (e.g. the
    trace context's `traceparent`); returns at once (wait with `head`). OSError or TimeoutError when the
    connection cannot be made."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(connect_timeout_s):
        transport, stream = await loop.create_connection(LlamaStream, host, port)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()) if headers else ""
    transport.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n{extra}"
                    f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n".encode("latin-1") + body)
    return stream
