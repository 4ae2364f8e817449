"""Waiting in a test for something another task or process does, bounded: one helper for every test that polls."""
from __future__ import annotations

import asyncio
import inspect


async def until(probe, expected=True, timeout_s: float = 10.0, what: str = "") -> None:
    """Wait until `probe()` (awaited if it returns an awaitable) equals `expected`; after `timeout_s` fail, saying
    `what` was awaited and the last value seen."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        got = probe()
        if inspect.isawaitable(got):
            got = await got
        if got == expected:
            return
        assert loop.time() < deadline, (
            f"waiting for {what or 'the probe'}: {got!r}, not {expected!r}, after {timeout_s} s")
        await asyncio.sleep(0.01)
