"""Which asyncio event loop the bench processes run on.

Ray runs async actors (so Pulse's gateway and workers) on uvloop when it is installed; the baseline relay,
the upstream and the load generator use the same loop by default, so the comparison is of the code path,
not of the event loop. `--loop asyncio` measures the standard loop instead.
"""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

CHOICES = ("auto", "uvloop", "asyncio")


def new_loop(kind: str = "auto") -> asyncio.AbstractEventLoop:
    if kind not in CHOICES:
        raise ValueError(f"loop must be one of {CHOICES}, not {kind!r}")
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def run(coro: Coroutine[Any, Any, Any], kind: str = "auto") -> Any:
    with asyncio.Runner(loop_factory=lambda: new_loop(kind)) as runner:
        return runner.run(coro)


def resolve(kind: str) -> str:
    """The loop that `kind` gives on this machine, for the result's record."""
    loop = new_loop(kind)
    loop.close()
    return loop_name(loop)
