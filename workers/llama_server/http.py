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

HIGH_WATER = 64 * 1024


class StreamClosed(ConnectionResetError):
    """The connection closed (by llama-server, by a crash, or by `close`) before the answer's end."""


class LlamaStream(asyncio.Protocol):
    """One request's connection and its answer, one-shot (`Connection: close`)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self._buf = b""  # not parsed yet: the head, a chunk frame cut by a read
        self._tail = b""  # the start of a line not complete yet
        self._mode = "head"  # head -> chunked | length | eof -> done
        self._left = 0  # bytes left in the current chunk (chunked) or the body (length)
        self._body: list[bytes] = []  # a non-200 answer's body
        self._lines: deque[bytes] = deque()
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
            self._parse(self._buf + data if self._buf else data)
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

    # ---- parsing -------------------------------------------------------------------------------
    def _parse(self, buf: bytes) -> None:
        if self._mode == "head":
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > 65536:
                    raise ValueError("response head too long")
                self._buf = buf
                return
            self._head(buf[:end].decode("latin-1"))
            buf = buf[end + 4:]
        if self._mode == "chunked":
            buf = self._chunks(buf)
        elif self._mode == "length":
            take = buf[:self._left]
            self._left -= len(take)
            self._payload(take)
            buf = b""
            if self._left == 0:
                self._finish()
        elif self._mode == "eof":
            self._payload(buf)
            buf = b""
        self._buf = buf if self._mode != "done" else b""

    def _head(self, head: str) -> None:
        status_line, *lines = head.split("\r\n")
        version, _, rest = status_line.partition(" ")
        if not version.startswith("HTTP/1."):
            raise ValueError(f"not an HTTP/1.x answer: {status_line[:80]!r}")
        self.status = int(rest[:3])
        for line in lines:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            self._mode = "chunked"
        elif "content-length" in self.headers:
            self._mode, self._left = "length", int(self.headers["content-length"])
            if self._left == 0:
                self._finish()
        else:
            self._mode = "eof"

    def _chunks(self, buf: bytes) -> bytes:
        """Consume whole chunks of a chunked body from `buf`; returns what is left (a partial frame)."""
        pos, n, parts = 0, len(buf), []
        while pos < n:
            if self._left > 0:  # inside a chunk's data
                take = min(self._left, n - pos)
                parts.append(buf[pos:pos + take])
                pos += take
                self._left -= take
                if self._left:
                    break
                self._left = -2  # its CRLF follows
            if self._left == -2:
                if n - pos < 2:
                    break
                pos += 2
                self._left = 0
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                if n - pos > 1024:
                    raise ValueError("chunk size line too long")
                break
            size = int(buf[pos:eol].split(b";", 1)[0], 16)
            if size == 0:  # the last chunk (trailers, if any, are not read: the connection is not reused)
                self._payload(b"".join(parts))
                self._finish()
                return b""
            pos = eol + 2
            self._left = size
        if parts:
            self._payload(b"".join(parts))
        return buf[pos:]

    def _payload(self, data: bytes) -> None:
        if not data:
            return
        if self.status != 200:
            self._body.append(data)
            return
        if self._tail:
            data = self._tail + data
        cut = data.rfind(b"\n") + 1
        self._tail = data[cut:]
        if cut:
            for line in data[:cut].split(b"\n"):
                if line.startswith((b"data: ", b"error: ")):
                    self._lines.append(line)
                    self._ready_bytes += len(line)

    def _finish(self) -> None:
        if self._tail.startswith((b"data: ", b"error: ")) and self.status == 200:
            self._lines.append(self._tail)
        self._tail = b""
        self._mode = "done"
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

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
        connection. llama-server sends them with the first token, after queueing and prefill."""
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
            if self._lines:
                line = self._lines.popleft()
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


async def open_stream(host: str, port: int, path: str, body: bytes, *, connect_timeout_s: float) -> LlamaStream:
    """Connect and send `body` (JSON) as a POST to `path`; returns at once (wait with `head`). OSError or
    TimeoutError when the connection cannot be made."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(connect_timeout_s):
        transport, stream = await loop.create_connection(LlamaStream, host, port)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    transport.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                    f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n".encode("latin-1") + body)
    return stream
