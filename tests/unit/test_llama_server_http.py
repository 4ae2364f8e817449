"""The llama-server stream client's parser (workers/llama_server/http.py) on the bytes llama-server sends.

The same answer, cut at every byte boundary and fed as separate reads, gives the same lines; an error answer
gives its body; a cut connection, a close() and an idle wait end a waiting reader the way the backend expects
(StreamClosed, a ConnectionError; TimeoutError). The real llama-server is exercised end to end by
tests/integration/test_llama_server_backend.py and test_llama_server_faults.py; here the bytes are fed by
hand, because a real server cannot be made to cut its answer at a chosen byte.
"""
from __future__ import annotations

import asyncio

import pytest

from tests.unit.http1_helpers import RecordingTransport, chunked, feed_in_reads
from workers.llama_server import api
from workers.llama_server.http import HIGH_WATER, LlamaStream, StreamClosed

EVENTS = [b'data: {"content":" t0","tokens":[1000],"stop":false,"id_slot":0}',
          b'data: {"content":" \xc3\xa9","tokens":[1001],"stop":false,"id_slot":0}',
          b'data: {"content":"","tokens":[],"stop":true,"stop_type":"limit","timings":{"predicted_n":2}}']


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
# one event per HTTP chunk, as llama-server writes them, plus one chunk holding two
BODY = chunked([EVENTS[0] + b"\n\n", EVENTS[1] + b"\n\n" + EVENTS[2] + b"\n\n"])


def _stream() -> tuple[LlamaStream, RecordingTransport]:
    s, t = LlamaStream(), RecordingTransport()
    s.connection_made(t)
    return s, t


async def _lines(s: LlamaStream) -> list[bytes]:
    assert await s.head(1.0)
    out = []
    while line := await s.line(1.0):
        out.append(line)
    return out


@pytest.mark.parametrize("step", [1, 2, 3, 7, 50, 10_000])
async def test_any_split_of_a_chunked_answer_gives_the_same_lines(step):
    s, _ = _stream()
    feed_in_reads(s, HEAD + BODY, step)
    assert await _lines(s) == EVENTS
    assert [api.decode_event(e[6:]).tokens for e in EVENTS[:2]] == [[1000], [1001]]


async def test_lines_arrive_as_they_are_read():
    s, _ = _stream()
    reader = asyncio.ensure_future(_lines(s))
    for i in range(0, len(HEAD + BODY), 5):
        s.data_received((HEAD + BODY)[i:i + 5])
        await asyncio.sleep(0)
    assert await reader == EVENTS


async def test_an_error_answer_gives_its_body():
    s, _ = _stream()
    body = b'{"error":{"code":400,"message":"the request exceeds the available context size","type":"exceed_context_size_error"}}'
    s.data_received(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
    assert await s.head(1.0) and s.status == 400
    s.data_received(body[10:])
    assert await s.body(1.0) == body
    err = api.error_of(s.status, body)
    assert err.status == 400 and "context size" in err.message


async def test_an_error_line_in_the_stream_is_a_line():
    s, _ = _stream()
    s.data_received(HEAD + chunked([EVENTS[0] + b"\n\n", b'error: {"message":"boom"}\n\n']))
    assert await _lines(s) == [EVENTS[0], b'error: {"message":"boom"}']


async def test_a_cut_connection_ends_a_waiting_reader():
    s, _ = _stream()
    s.data_received(HEAD + chunked([EVENTS[0] + b"\n\n"])[:-5])  # no terminating chunk
    assert await s.head(1.0)
    assert await s.line(1.0) == EVENTS[0]
    waiting = asyncio.ensure_future(s.line(5.0))
    await asyncio.sleep(0)
    s.connection_lost(None)
    with pytest.raises(StreamClosed):
        await waiting
    assert isinstance(StreamClosed(), ConnectionError)


async def test_close_ends_the_wait_for_headers_and_closes_the_transport():
    s, t = _stream()
    waiting = asyncio.ensure_future(s.head(5.0))
    await asyncio.sleep(0)
    s.close()
    with pytest.raises(StreamClosed):
        await waiting
    assert t.closed


async def test_no_headers_within_the_timeout_is_false_and_the_stream_stays_usable():
    s, _ = _stream()
    assert await s.head(0.01) is False
    s.data_received(HEAD + BODY)
    assert await _lines(s) == EVENTS


async def test_an_idle_stream_times_out():
    s, _ = _stream()
    s.data_received(HEAD)
    assert await s.head(1.0)
    with pytest.raises(TimeoutError):
        await s.line(0.01)


async def test_unread_lines_past_high_water_pause_the_socket_until_read():
    s, t = _stream()
    line = b"data: " + b"x" * 1000
    s.data_received(HEAD + chunked([line + b"\n\n"] * (HIGH_WATER // 1000 + 2))[:-5])
    assert await s.head(1.0) and t.paused
    while s._lines_ready:
        assert await s.line(1.0) == line
    assert not t.paused


async def test_malformed_framing_closes_the_stream():
    s, t = _stream()
    s.data_received(HEAD + b"zz\r\n")
    assert await s.head(1.0)
    with pytest.raises(StreamClosed):
        await s.line(1.0)
    assert t.closed


async def test_open_stream_sends_the_extra_headers_with_the_request():
    """The trace context's `traceparent` goes to llama-server as a header of the POST (a loopback server reads
    the request as llama-server would get it)."""
    from workers.llama_server.http import open_stream

    got: asyncio.Future = asyncio.get_running_loop().create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")][0].split(b":")[1])
        got.set_result((head, await reader.readexactly(length)))
        writer.write(HEAD + BODY)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        s = await open_stream("127.0.0.1", port, "/completion", b'{"prompt":[1]}', connect_timeout_s=5,
                              headers={"traceparent": parent})
        head, body = await asyncio.wait_for(got, 5)
        lines = head.split(b"\r\n")
        assert lines[0] == b"POST /completion HTTP/1.1" and f"traceparent: {parent}".encode() in lines
        assert body == b'{"prompt":[1]}'
        assert await _lines(s) == EVENTS
        s.close()
    finally:
        server.close()
        await server.wait_closed()
