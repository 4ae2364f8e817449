"""Long request bodies are parsed on a thread, short ones inline; a parse error reaches the caller as is."""
from __future__ import annotations

import threading

import pytest

from gateway.completions import OFF_LOOP_BYTES, parse_off_loop
from gateway.errors import APIError


def _thread_of(body: bytes) -> str:
    return threading.current_thread().name


async def test_short_inline_long_on_a_thread():
    here = threading.current_thread().name
    assert await parse_off_loop(_thread_of, b"x" * 100) == here
    assert await parse_off_loop(_thread_of, b"x" * OFF_LOOP_BYTES) != here


async def test_errors_come_back_unchanged():
    def bad(body: bytes):
        raise APIError(400, "nope", param="messages")

    for n in (10, OFF_LOOP_BYTES + 1):
        with pytest.raises(APIError) as e:
            await parse_off_loop(bad, b"x" * n)
        assert e.value.status == 400 and e.value.param == "messages"
