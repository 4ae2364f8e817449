"""HTTP/1.1 response framing, fed as bytes arrive, for Pulse's two streaming clients: the gateway's channel to its
workers (gateway/channel.py) and the llama-server backend's stream client (workers/llama_server/http.py).

The status line and headers, then a chunked, Content-Length or EOF-delimited body; a 200's body is handed on as
complete lines (`_take_lines`, and `_last_line` for an unterminated last one at the end), any other status's body is
kept whole. Both clients are hand-written instead of aiohttp's client for the per-request and per-line objects it
makes on the per-token path (their module docstrings have the figures); this is the part they share.

A subclass sets `peer` (named in errors), implements `_take_lines` and `_last_line`, and calls `_reset_framing()`
before a response and `_feed(data)` from `data_received` (ValueError: a malformed frame). `_finish` marks the
response done and wakes the reader waiting on `_waiter`.
"""
from __future__ import annotations


class ResponseFraming:
    peer = "the server"

    def _reset_framing(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self._buf = b""  # bytes not parsed yet (head, chunk framing)
        self._tail = b""  # the start of a line not complete yet
        self._mode = "head"  # head -> chunked | length | eof -> done
        self._left = 0  # bytes left in the current chunk (chunked) or the body (length)
        self._body: list[bytes] = []  # a non-200 answer's body
        self._keep = True  # the server lets the connection be reused after this response
        self._waiter = None  # the reader's future while it waits (the subclass's reader sets it)

    # hooks
    def _take_lines(self, block: bytes) -> None:
        """Complete lines of a 200's body (`block` ends with a newline)."""
        raise NotImplementedError

    def _last_line(self, line: bytes) -> None:
        """What is left of a 200's body after its last newline, at the end of the body."""
        raise NotImplementedError

    def _wake(self) -> None:
        """Wake the reader waiting on `_waiter` (a future the subclass's reader sets)."""
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # parsing
    def _feed(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        if self._mode == "head":
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > 65536:
                    raise ValueError(f"{self.peer}'s response head too long")
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
            buf = buf[len(take):]
            if self._left == 0:
                self._finish()
        elif self._mode == "eof":
            self._payload(buf)
            buf = b""
        if buf and self._mode == "done":
            raise ValueError(f"bytes after the end of {self.peer}'s response")
        self._buf = buf

    def _head(self, head: str) -> None:
        status_line, *lines = head.split("\r\n")
        version, _, rest = status_line.partition(" ")
        if not version.startswith("HTTP/1."):
            raise ValueError(f"not an HTTP/1.x answer: {status_line[:80]!r}")
        self.status = int(rest[:3])
        for line in lines:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        if self.headers.get("connection", "").lower() == "close" or version == "HTTP/1.0":
            self._keep = False
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            self._mode = "chunked"
        elif "content-length" in self.headers:
            self._mode, self._left = "length", int(self.headers["content-length"])
            if self._left == 0:
                self._finish()
        else:
            self._mode, self._keep = "eof", False

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
                    raise ValueError(f"{self.peer}'s chunk size line too long")
                break
            size = int(buf[pos:eol].split(b";", 1)[0], 16)
            if size == 0:  # the last chunk; no trailers are expected, only the final CRLF
                end = buf.find(b"\r\n", eol + 2)
                if end < 0:
                    break
                self._payload(b"".join(parts))
                self._finish()
                return buf[end + 2:]
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
            self._take_lines(data[:cut])

    def _finish(self) -> None:
        if self._tail and self.status == 200:
            self._last_line(self._tail)
        self._tail = b""
        self._mode = "done"
        self._wake()
