"""The gateway's worker-channel parser (gateway/channel.py) on the bytes a worker's aiohttp server sends.

The same answer, cut at every byte boundary and fed as separate reads, gives the same Chunks; an error answer
gives its body; a torn line or bad framing is a ValueError (what the relay treats as a broken stream).
"""
from __future__ import annotations

import asyncio

import pytest

from gateway.channel import Channels, WorkerStream
from tests.unit.http1_helpers import RecordingTransport, chunked, feed_in_reads
from workers.protocol import Chunk, Usage, encode

CHUNKS = [Chunk(text=" t0", token_ids=[1000]), Chunk(text=" é\n", token_ids=[1001]),
          Chunk(finish_reason="length", usage=Usage(prompt_tokens=3, completion_tokens=2))]


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"
# one line per HTTP chunk, as the worker writes them, plus one chunk holding two lines
BODY = chunked([encode(CHUNKS[0]) + b"\n", encode(CHUNKS[1]) + b"\n" + encode(CHUNKS[2]) + b"\n"])


def _stream() -> tuple[WorkerStream, RecordingTransport]:
    s = WorkerStream(Channels(), ("127.0.0.1", 1))
    t = RecordingTransport()
    s.connection_made(t)
    return s, t


async def _read(s: WorkerStream) -> list[Chunk]:
    await s.head()
    return [c async for batch in s.batches() for c in batch]


@pytest.mark.parametrize("step", [1, 2, 3, 7, 50, 10_000])
async def test_any_split_of_a_chunked_answer_gives_the_same_chunks(step):
    s, t = _stream()
    feed_in_reads(s, HEAD + BODY, step)
    assert await _read(s) == CHUNKS
    s.close()
    assert not t.closed  # read to its end: kept for the next request


async def test_an_error_answer_gives_its_body():
    s, _ = _stream()
    body = b'{"error": {"message": "busy", "code": "no_capacity"}}'
    s.data_received(b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:10])
    await s.head()
    assert s.status == 429
    s.data_received(body[10:])
    assert await s.body() == body


async def test_a_torn_line_is_a_value_error_after_the_good_ones():
    s, t = _stream()
    s.data_received(HEAD + chunked([encode(CHUNKS[0]) + b"\n{\"text\": 12\n"]))
    await s.head()
    got = []
    with pytest.raises(ValueError):
        async for batch in s.batches():
            got += batch
    assert got == [CHUNKS[0]] and t.closed


async def test_bad_framing_is_a_value_error():
    s, t = _stream()
    s.data_received(HEAD + b"zz\r\n")
    with pytest.raises(ValueError):
        await _read(s)
    assert t.closed


async def test_a_connection_cut_mid_answer_raises_and_is_not_kept():
    channels = Channels()
    s = WorkerStream(channels, ("127.0.0.1", 1))
    s.connection_made(RecordingTransport())
    s.data_received(HEAD + BODY[:20])
    await s.head()
    s.connection_lost(None)
    with pytest.raises(ConnectionResetError):
        await _read(s)
    s.close()
    assert channels.idle_count() == 0


async def test_a_reader_that_stops_pauses_the_socket_and_reading_resumes_it():
    s, t = _stream()
    line = encode(Chunk(text="x" * 1000, token_ids=[1])) + b"\n"
    s.data_received(HEAD + b"".join(f"{len(line):x}\r\n".encode() + line + b"\r\n" for _ in range(80)))
    assert t.paused  # 80 KB of lines unread: stop reading the worker
    await s.head()
    it = s.batches()
    assert len(await it.__anext__()) == 80 and not t.paused


async def test_no_data_within_the_read_timeout_is_a_timeout():
    s = WorkerStream(Channels(read_timeout_s=0.05), ("127.0.0.1", 1))
    s.connection_made(RecordingTransport())
    with pytest.raises(asyncio.TimeoutError):
        await s.head()
