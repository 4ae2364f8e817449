"""Calls to Redis that fail fast: a hard per-call timeout and a short open circuit after a failure.

    client = make_client(cfg.redis.url, cfg.redis.timeout_s)
    guard = RedisGuard(cfg.redis.timeout_s, cfg.redis.retry_interval_s, error_cls=IndexUnavailable)
    value = await guard.run(lambda: client.get("k"), "get")

Why: the gateway asks Redis on every request. When Redis is down, slow or restarting, a request must
not wait on it: after one failure, calls raise `error_cls` at once for `retry_interval_s`, then one
call tries again while the others still fail fast. The first success after a failure calls `on_recovered`
(sync, or async: then run as a task), which is where the index asks workers to republish (refill) what
Redis missed.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)
T = TypeVar("T")


# The configured redis.timeout_s (50 ms) suits routing hints: past it a request routes on load alone. A call
# whose failure the caller sees as a 503 (checking an API key, reading a stored conversation) waits at least
# this long: a busy box's slow round trip (a fresh connection after a restart, a loaded event loop) is not
# an outage.
ANSWER_TIMEOUT_S = 1.0


class RedisUnavailable(Exception):
    """Redis did not answer in time, or failed within the last retry interval."""


def make_client(url: str, timeout_s: float, max_connections: int = 64) -> aioredis.Redis:
    """An asyncio Redis client that gives up after `timeout_s` and never retries on its own (the guard decides)."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        max_connections=max_connections,
        decode_responses=True,
        health_check_interval=0,
    )


_FAILURES = (RedisConnectionError, RedisTimeoutError, TimeoutError, OSError)


class RedisGuard:
    def __init__(
        self,
        timeout_s: float,
        retry_interval_s: float = 1.0,
        error_cls: type[Exception] = RedisUnavailable,
        on_recovered: Callable[[], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.timeout_s = timeout_s
        self.retry_interval_s = retry_interval_s
        self.error_cls = error_cls
        self.on_recovered = on_recovered
        self._clock = clock
        self._down_until = 0.0
        self._failed = False
        self._probing = False  # after a failure, the one call trying Redis again is in flight
        self.failures = 0  # calls that failed (for metrics)
        self.recoveries = 0
        self._tasks: set[asyncio.Task] = set()

    @property
    def available(self) -> bool:
        """False while the circuit is open (a recent failure); the next call after it closes tries Redis."""
        return self._clock() >= self._down_until

    async def run(
        self,
        call: Callable[[], Awaitable[T]],
        what: str,
        timeout_s: float | None = None,
        lost_state: Callable[[T], bool] | None = None,
    ) -> T:
        """`call()` within the timeout. `lost_state(result)` True means Redis answered but had lost its
        contents (restarted empty): `on_recovered` fires then too, once."""
        if self._clock() < self._down_until:
            raise self.error_cls(
                f"redis unavailable ({what}): a call failed within the last {self.retry_interval_s:g} s"
            )
        # After a failure one call tries Redis again; the others fail fast until it answers. Without this every
        # call arriving while that try waits out its timeout waited too: a frozen Redis held each of 16 clients'
        # key checks its 1 s (ANSWER_TIMEOUT_S) once a retry interval (the reliability test's p99 1,070 ms)
        if self._failed and self._probing:
            raise self.error_cls(f"redis unavailable ({what}): another call is trying it after a failure")
        probe = self._probing = self._failed
        try:
            async with asyncio.timeout(timeout_s or self.timeout_s):
                result = await call()
        except _FAILURES as e:
            self._trip(what, e)
            raise self.error_cls(f"redis {what} failed: {type(e).__name__}") from e
        finally:
            if probe:
                self._probing = False
        lost = lost_state is not None and lost_state(result)
        if self._failed or lost:
            self._recovered()
        return result

    def _trip(self, what: str, error: BaseException) -> None:
        self.failures += 1
        if not self._failed:
            log.warning("redis %s failed (%s); failing fast for %.1f s",
                        what, type(error).__name__, self.retry_interval_s)
        self._failed = True
        self._down_until = self._clock() + self.retry_interval_s

    def _recovered(self) -> None:
        self._failed = False
        self.recoveries += 1
        log.info("redis is back; asking publishers to refill")
        if self.on_recovered is None:
            return
        result = self.on_recovered()
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(result)
            self._tasks.add(task)  # keep a reference until it finishes
            task.add_done_callback(self._tasks.discard)
