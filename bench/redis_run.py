"""A real redis-server for a benchmark run (the tests' RedisServer: a free loopback port, no persistence).

    with bench_redis() as server:      # server.url
        ...
"""
from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from tests.conftest_redis import RedisServer


@contextmanager
def bench_redis() -> Iterator[RedisServer]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed")
    server = RedisServer(binary)
    server.start()
    try:
        yield server
    finally:
        server.close()
