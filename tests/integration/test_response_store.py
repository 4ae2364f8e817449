"""The Responses API's Redis store against a real redis-server: entries round-trip with a TTL, an entry
over the size bound is refused unwritten, and a Redis that is gone or frozen is a prompt StoreUnavailable
(the adapter answers 503 for a read, and leaves the response unstored for a write)."""
from __future__ import annotations

import time

import pytest
import redis as sync_redis

from gateway.response_store import RedisResponseStore, StoreUnavailable
from tests.conftest_redis import redis_server  # noqa: F401  (the fixture)


def store_at(url: str, **kw) -> RedisResponseStore:
    kw = {"namespace": "pulse:", "ttl_s": 60.0, "max_bytes": 1024, "timeout_s": 0.05, "retry_interval_s": 0.2, **kw}
    return RedisResponseStore(url, **kw)


async def test_round_trip_with_ttl_and_size_bound(redis_server):
    store = store_at(redis_server.url)
    try:
        assert await store.put("resp_1", b'{"a": 1}')
        assert await store.get("resp_1") == b'{"a": 1}'
        ttl = sync_redis.Redis.from_url(redis_server.url).ttl("pulse:response:resp_1")
        assert 0 < ttl <= 60
        assert not await store.put("resp_big", b"x" * 1025)
        assert await store.get("resp_big") is None
        assert await store.delete("resp_1") and not await store.delete("resp_1")
        assert await store.get("resp_1") is None
    finally:
        await store.close()


async def test_redis_gone_or_frozen_is_store_unavailable_promptly(redis_server):
    store = store_at(redis_server.url)
    try:
        await store.put("resp_1", b"{}")
        redis_server.pause()
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.get("resp_1")
        assert time.monotonic() - t0 < 2.0  # its own timeout (at least 1 s), not a hang
        redis_server.resume()
        redis_server.stop()
        with pytest.raises(StoreUnavailable):
            await store.put("resp_2", b"{}")
    finally:
        await store.close()
