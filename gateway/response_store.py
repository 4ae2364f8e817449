"""Where the Responses API keeps stored responses: Redis when configured, else in process.

    store = open_response_store(cfg)          # RedisResponseStore at cfg.redis.url, else MemoryResponseStore
    ok = await store.put(response_id, data)   # False: larger than cfg.responses.max_entry_bytes, not stored
    data = await store.get(response_id)       # bytes | None; raises StoreUnavailable when Redis is away
    gone = await store.delete(response_id)

An entry is opaque bytes to the store (gateway/responses_api.py encodes the response object and the
conversation behind it). In Redis an entry is one key with a TTL, so every gateway replica and a restarted
gateway read the same conversation; the in-process store (the single box without Redis) is a TTL cache
bounded by total bytes, and forgets everything when the gateway restarts.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import cachetools

from cache.redis_guard import ANSWER_TIMEOUT_S, RedisGuard, RedisUnavailable, make_client


class StoreUnavailable(RedisUnavailable):
    """The store did not answer (Redis down or slow)."""


class ResponseStore(ABC):
    """The contract: bytes in, the same bytes out until `ttl_s` passes or `delete`; entries over
    `max_bytes` are refused (put returns False) rather than truncated."""

    def __init__(self, ttl_s: float, max_bytes: int):
        self.ttl_s, self.max_bytes = ttl_s, max_bytes

    @abstractmethod
    async def put(self, rid: str, data: bytes) -> bool:
        ...

    @abstractmethod
    async def get(self, rid: str) -> bytes | None:
        ...

    @abstractmethod
    async def delete(self, rid: str) -> bool:
        ...

    async def close(self) -> None:
        pass


class MemoryResponseStore(ResponseStore):
    """One gateway process: a TTL cache whose size is the bytes it holds (least recently used go first)."""

    def __init__(self, ttl_s: float, max_bytes: int, memory_bytes: int):
        super().__init__(ttl_s, min(max_bytes, memory_bytes))
        self._cache: cachetools.TTLCache = cachetools.TTLCache(maxsize=memory_bytes, ttl=ttl_s, getsizeof=len)

    async def put(self, rid: str, data: bytes) -> bool:
        if len(data) > self.max_bytes:
            return False
        self._cache[rid] = data
        return True

    async def get(self, rid: str) -> bytes | None:
        return self._cache.get(rid)

    async def delete(self, rid: str) -> bool:
        return self._cache.pop(rid, None) is not None


class RedisResponseStore(ResponseStore):
    """Shared by every gateway: one key per response, `SET ... EX ttl`."""

    def __init__(self, url: str, *, namespace: str, ttl_s: float, max_bytes: int, timeout_s: float,
                 retry_interval_s: float):
        super().__init__(ttl_s, max_bytes)
        timeout_s = max(timeout_s, ANSWER_TIMEOUT_S)  # a conversation is not a routing hint
        self.prefix = namespace + "response:"
        self.client = make_client(url, timeout_s, max_connections=16)
        self.guard = RedisGuard(timeout_s, retry_interval_s, StoreUnavailable)

    async def put(self, rid: str, data: bytes) -> bool:
        if len(data) > self.max_bytes:
            return False
        await self.guard.run(lambda: self.client.set(self.prefix + rid, data, ex=max(1, int(self.ttl_s))), "put")
        return True

    async def get(self, rid: str) -> bytes | None:
        value = await self.guard.run(lambda: self.client.get(self.prefix + rid), "get")
        return value.encode() if isinstance(value, str) else value

    async def delete(self, rid: str) -> bool:
        return bool(await self.guard.run(lambda: self.client.delete(self.prefix + rid), "delete"))

    async def close(self) -> None:
        await self.client.aclose()


def open_response_store(cfg) -> ResponseStore:
    """From a PulseConfig: Redis at cfg.redis.url (every replica, survives restarts), else in process."""
    r = cfg.responses
    if cfg.redis.url:
        return RedisResponseStore(cfg.redis.url, namespace=cfg.redis.namespace, ttl_s=r.ttl_s,
                                  max_bytes=r.max_entry_bytes, timeout_s=cfg.redis.timeout_s,
                                  retry_interval_s=cfg.redis.retry_interval_s)
    return MemoryResponseStore(r.ttl_s, r.max_entry_bytes, r.memory_bytes)
