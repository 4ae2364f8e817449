"""The gateway's end of the worker channel (workers/stream.py): HTTP/1.1 over pooled keep-alive connections,
parsed here.

The channel is Pulse's at both ends: a POST /generate answered by a chunked stream of ndjson Chunk lines (or,
on refusal, a short JSON error body). A general HTTP client does work per request (URL and header objects,
timers, a stream reader fed once per HTTP chunk, an iterator woken once per read) that this fixed exchange
does not need; on the per-token path that was a large part of the gateway's CPU. Here one `data_received`
call parses what one read brought in (chunk framing and every complete line, decoded in one msgspec call)
and wakes the reader once.

    channels = Channels(connect_timeout_s=5, read_timeout_s=60)
    stream = await channels.open("http://127.0.0.1:9000", "/generate", body, secret)  # OSError/TimeoutError
    if stream.status != 200: body = await stream.body()   # the worker's error JSON
    async for batch in stream.batches(): ...                # list[Chunk] per wake-up, in order
    stream.close()                                          # always; mid-stream it drops the connection,
                                                            # which cancels the generation on the worker
    await channels.close()

Backpressure is kept: once `HIGH_WATER` bytes of decoded-but-unread lines pile up the socket stops being
read, the kernel's bounded receive buffer fills, and the worker's writes block (its generation pauses). A
connection is reused only after its response was read to the end; an idle one is dropped after
`keepalive_s` (below the worker's server keep-alive, so the worker never closes one as it is handed out),
and a reused one that the worker closed before answering is retried once on a fresh connection.
"""
from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from functools import lru_cache
from urllib.parse import urlsplit

import msgspec

from workers.protocol import Chunk
from workers.protocol.http1 import ResponseFraming

RCVBUF = 256 * 1024  # a worker socket's receive buffer: what piles up in the kernel for a stream stays bounded
HIGH_WATER = 64 * 1024  # bytes of unread lines at which this end stops reading the socket
LINGER_S = 1.0  # how long a stream closed after its final chunk waits for the chunked terminator to keep its connection
_lines = msgspec.json.Decoder(Chunk)


class StaleConnection(ConnectionResetError):
    """A reused connection closed by the worker before any byte of the answer: safe to send again."""


@lru_cache(maxsize=1024)  # worker addresses (from Ray, not clients); a few per gateway
def _address(url: str) -> tuple[str, int, str]:
    """(host, port, the Host header's value) of a worker's channel URL."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"worker channel URL must be http://host:port, not {url!r}")
    return parts.hostname, parts.port or 80, parts.netloc


class WorkerStream(ResponseFraming, asyncio.Protocol):
    """One connection to a worker and the response being read on it (one at a time: no pipelining)."""

    peer = "the worker"

    def __init__(self, pool: Channels, key: tuple[str, int]):
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self.reused = False
        self._reset()

    def _reset(self) -> None:
        self._reset_framing()
        self._ready: list[Chunk] = []
        self._ready_bytes = 0
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._paused = False
        self._got_bytes = False
        self._final = False  # a chunk with a finish_reason was decoded: the generation's answer is complete
        self._linger: asyncio.TimerHandle | None = None  # closed after its final chunk, waiting for the terminator

    # ---- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.transport = None
        if self._mode == "done":
            self.pool.forget(self)  # closed while idle (or after its answer): not kept, whatever its address
        elif self._mode == "eof" and exc is None:
            self._finish()
        elif self._mode != "done" and self._error is None:
            if not self._got_bytes and self.reused:
                self._error = StaleConnection("the worker closed a kept-alive connection")
            else:
                self._error = exc or ConnectionResetError("the worker closed the stream mid-response")
        self._wake()

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        try:
            self._feed(data)
        except ValueError as e:  # a malformed frame or line (msgspec.DecodeError too): end the stream with it
            self._keep = False
            self._error = e
            if self.transport is not None:
                self.transport.close()
        if self._linger is not None and self._mode == "done" and self.transport is not None:
            self._linger.cancel()
            self._linger = None
            self.close()  # its terminator came in after all: the connection goes back to the pool
            return
        if self._ready_bytes >= HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self):
        return None  # close; connection_lost ends the response (EOF-delimited bodies) or reports it cut

    # ---- parsing (workers/protocol/http1.py) ---------------------------------------------------
    def _take_lines(self, block: bytes) -> None:
        _decode_into(self._ready, block)
        self._ready_bytes += len(block)
        if self._ready:
            self._final = self._ready[-1].finish_reason is not None

    def _last_line(self, line: bytes) -> None:
        if line.strip():
            _decode_into(self._ready, line)

    # ---- the reader's side ---------------------------------------------------------------------
    async def _wait(self) -> None:
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        timer = loop.call_later(self.pool.read_timeout_s, _expire, self._waiter)
        try:
            await self._waiter
        finally:
            timer.cancel()
            self._waiter = None

    async def head(self) -> None:
        """Wait for the status line and headers (raises what cut the connection, or TimeoutError)."""
        while self._mode == "head":
            if self._error is not None:
                raise self._error
            await self._wait()

    async def body(self) -> bytes:
        """The whole body of a non-200 answer."""
        while self._mode != "done":
            if self._error is not None:
                raise self._error
            await self._wait()
        return b"".join(self._body)

    async def batches(self) -> AsyncIterator[list[Chunk]]:
        """The Chunks as they arrive: each batch is everything read since the last one."""
        while True:
            if self._ready:
                batch, self._ready, self._ready_bytes = self._ready, [], 0
                if self._paused and self.transport is not None:
                    self._paused = False
                    self.transport.resume_reading()
                yield batch
                continue
            if self._mode == "done":
                return
            if self._error is not None:
                raise self._error
            await self._wait()

    def close(self) -> None:
        """Done with this response (call it once): a connection whose answer came to its end waits for the
        next request to that worker; one still streaming is closed (the worker then cancels the generation).

        The worker writes its final line and the chunked terminator in one write (workers/stream.py); where
        they still arrive apart (split on the way, or a worker from before that change) and a reader stops at
        the final chunk before the terminator is in, the connection waits up to LINGER_S for it and goes back
        to the pool, instead of being dropped (the next request to that worker would pay a new connection at
        both ends)."""
        if self.transport is None:
            return
        if self._mode == "done" and self._keep and self._error is None:
            if self._paused:
                self._paused = False
                self.transport.resume_reading()
            self.pool.release(self)
        elif self._final and self._mode == "chunked" and self._keep and self._error is None and not self._paused:
            self._linger = asyncio.get_running_loop().call_later(LINGER_S, self._drop)
        else:
            self._drop()

    def _drop(self) -> None:
        self._linger = None
        self._keep = False
        if self.transport is not None:
            self.transport.close()
            self.transport = None


def _decode_into(ready: list[Chunk], lines: bytes) -> None:
    """Append every line's Chunk, decoded in one call; on a bad line the good ones before it are appended,
    then it raises."""
    try:
        ready += _lines.decode_lines(lines)
    except msgspec.DecodeError:
        for line in lines.split(b"\n"):
            if line.strip():
                ready.append(_lines.decode(line))  # raises at the bad one


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError("no data from the worker within the read timeout"))


class Channels:
    """Keep-alive connections to workers, by address; opens one response at a time on each."""

    def __init__(self, *, connect_timeout_s: float = 5.0, read_timeout_s: float = 60.0, keepalive_s: float = 60.0):
        self.connect_timeout_s, self.read_timeout_s, self.keepalive_s = connect_timeout_s, read_timeout_s, keepalive_s
        self._idle: dict[tuple[str, int], list[WorkerStream]] = {}
        self._closed = False

    async def open(self, url: str, path: str, body: bytes, secret: str) -> WorkerStream:
        """POST `body` (JSON) to `url` + `path`; returns once the answer's head is in (any status)."""
        host, port, netloc = _address(url)
        key = (host, port)
        head = (f"POST {path} HTTP/1.1\r\nHost: {netloc}\r\nAuthorization: Bearer {secret}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode("latin-1")
        for _ in range(2):
            conn = self._take(key) or await self._connect(key)
            conn.transport.write(head + body)
            try:
                await conn.head()
                return conn
            except StaleConnection:
                continue  # the worker closed it while idle: nothing reached it, send again on a new one
            except BaseException:
                conn.close()
                raise
        raise ConnectionResetError("the worker closed two connections before answering")

    def _take(self, key) -> WorkerStream | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.transport is not None and not conn.transport.is_closing() and now - conn.idle_since < self.keepalive_s:
                conn._reset()
                conn.reused = True
                return conn
            if conn.transport is not None:
                conn.transport.close()
        return None

    async def _connect(self, key: tuple[str, int]) -> WorkerStream:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            family, type_, proto, _, addr = (await loop.getaddrinfo(*key, type=socket.SOCK_STREAM))[0]
            sock = socket.socket(family, type_, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)  # before connect: sets the window
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setblocking(False)
                await loop.sock_connect(sock, addr)
                _, conn = await loop.create_connection(lambda: WorkerStream(self, key), sock=sock)
            except BaseException:
                sock.close()
                raise
        return conn

    def release(self, conn: WorkerStream) -> None:
        """A response read to its end: its connection waits for the next request to that worker."""
        if self._closed:
            conn.transport.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)

    def forget(self, conn: WorkerStream) -> None:
        idle = self._idle.get(conn.key)
        if idle is not None and conn in idle:
            idle.remove(conn)
            if not idle:
                del self._idle[conn.key]  # a worker gone for good (restarted at a new address) leaves nothing

    def idle_count(self) -> int:
        """Connections waiting for a request."""
        return sum(1 for idle in self._idle.values() for c in idle if c.transport is not None)

    async def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                if conn.transport is not None:
                    conn.transport.close()
        self._idle.clear()
