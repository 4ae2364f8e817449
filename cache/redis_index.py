"""The Redis PrefixIndex: many gateways and many boxes share one view of who caches what.

    index = RedisPrefixIndex.from_config(cfg.redis, ttl_s=cfg.routing.block_ttl_s, on_recovered=refill)
    await index.connect()                 # optional: loads the scripts within the bulk timeout
    hits = await index.longest_prefix(chain_hashes(prompt_ids, block_size))   # {worker_id: blocks}
    ...
    await index.close()

Same contract as cache.index.PrefixIndex. Every method is one Lua script: one round trip, atomic; except a
snapshot of more than `snapshot_part` hashes, which goes in parts (see `snapshot`).
Failures raise IndexUnavailable within `timeout_s` (RedisConfig.timeout_s), and for `retry_interval_s`
after one, calls raise at once (cache.redis_guard). `on_recovered` is called when Redis answers again
after failures, or when it answers with its contents gone (restarted without persistence): the
caller then asks every worker for a `snapshot`.

Layout and scripts: cache/redis_scripts.py. In short: one hash field per block hash holding the bit mask of
which workers (slots in a small id table) hold it, per tier, beside a per-worker set of its blocks (the
reverse index for snapshot, drop and cleaning). A lookup walks the prompt's blocks once, AND-ing masks
until every worker has dropped out: exact (any gap ends a worker's match), and ~1 field read per matched
block for all workers together. For 16k tokens x 8 workers that is 1,024 reads instead of the per-worker
set layout's 4,608 membership checks (bench/prefix_lookup.py runs both). Expiry is per worker: a
worker's liveness key expires `ttl_s` after its last publish, evict or snapshot; lookups then ignore its
bits, and later writes clean them out (a bounded number per call) before its slot is reused. A lapsed
worker's entries do not come back with its next publish (it gets a fresh slot).
Migration: the layout lives under NS pfx2: (a version in the key names). The per-worker-set layout's keys
(NS pfx:w:...) carry TTLs and lapse on their own; its NS pfx:workers set and NS pfx:epoch token (two
small keys) stay until deleted by hand. Gateways and workers on different layouts do not see each other's
entries: such a gateway routes on load alone until both sides run the same version.
Cost: a lookup walks each group of 10 slots that has a live worker, so past 10 live workers (or after
restarts that leave slots being cleaned) it costs one walk per group.
Standalone Redis only: scripts touch keys they compute (no Redis Cluster).
"""
from __future__ import annotations

import secrets
import struct
from collections.abc import Callable, Collection, Mapping, Sequence

import redis.asyncio as aioredis

from cache import redis_scripts
from cache.index import ALL_TIERS, TIER_BITS, IndexUnavailable, PrefixIndex, Tier, tier_mask
from cache.redis_guard import RedisGuard, make_client


def _pack(hashes: Sequence[int]) -> bytes:
    return struct.pack(f">{len(hashes)}Q", *hashes)


class RedisPrefixIndex(PrefixIndex):
    SCRIPTS = {"publish": redis_scripts.PUBLISH, "evict": redis_scripts.EVICT, "drop": redis_scripts.DROP,
               "snapshot": redis_scripts.SNAPSHOT, "snapshot_part": redis_scripts.SNAPSHOT_PART,
               "snapshot_end": redis_scripts.SNAPSHOT_END, "longest": redis_scripts.LONGEST}

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        namespace: str = "pulse:",
        ttl_s: float = 600.0,
        timeout_s: float = 0.05,
        retry_interval_s: float = 1.0,
        bulk_timeout_s: float = 5.0,
        snapshot_part: int = 2048,
        on_recovered: Callable[[], object] | None = None,
    ):
        self._r = client
        self.namespace = namespace
        self.ttl_s = max(1, int(ttl_s))
        self.bulk_timeout_s = bulk_timeout_s  # snapshot and drop_worker move whole block sets
        self.snapshot_part = snapshot_part  # a snapshot of more hashes goes in parts of this many
        self.guard = RedisGuard(timeout_s, retry_interval_s, IndexUnavailable, on_recovered)
        self._epoch: str | None = None
        self._scripts = {name: client.register_script(src) for name, src in self.SCRIPTS.items()}

    @classmethod
    def from_config(cls, redis_cfg, *, ttl_s: float = 600.0, on_recovered=None) -> RedisPrefixIndex:
        """From policy.config.RedisConfig (its url must be set)."""
        if not redis_cfg.url:
            raise ValueError("RedisPrefixIndex needs redis.url; use MemoryPrefixIndex on a single box")
        return cls(
            make_client(redis_cfg.url, redis_cfg.timeout_s),
            namespace=redis_cfg.namespace,
            ttl_s=ttl_s,
            timeout_s=redis_cfg.timeout_s,
            retry_interval_s=redis_cfg.retry_interval_s,
            on_recovered=on_recovered,
        )

    @property
    def available(self) -> bool:
        return self.guard.available

    async def connect(self) -> None:
        """Open a connection and load the scripts, with the bulk timeout (call once at start, so the
        first request does not pay for it within the short per-call timeout). Raises IndexUnavailable."""

        async def load():
            for script in self._scripts.values():
                script.sha = await self._r.script_load(script.script)

        await self.guard.run(load, "connect", self.bulk_timeout_s)

    async def publish(self, worker_id: str, hashes: Sequence[int], tier: Tier = "gpu") -> None:
        if hashes:
            await self._call("publish", [worker_id, _tier_name(tier), self.ttl_s, _pack(hashes)])

    async def evict(self, worker_id: str, hashes: Sequence[int], tier: Tier | None = None) -> None:
        if hashes:
            await self._call("evict", [worker_id, tier_mask(tier), self.ttl_s, _pack(hashes)])

    async def drop_worker(self, worker_id: str) -> None:
        await self._call("drop", [worker_id], self.bulk_timeout_s)

    async def snapshot(self, worker_id: str, blocks: Mapping[Tier, Sequence[int]]) -> None:
        """Replace the worker's entries. Up to `snapshot_part` hashes: one script, atomic. More: in parts of
        that many, each its own short script (lookups in between see the new blocks as each part lands and
        the dropped ones until the end), so a big worker's snapshot does not hold Redis for ~100 ms."""
        if sum(len(h) for h in blocks.values()) <= self.snapshot_part:
            args: list = [worker_id, self.ttl_s, "1"]
            for tier, hashes in blocks.items():
                args += [_tier_name(tier), _pack(hashes)]
            await self._call("snapshot", args, self.bulk_timeout_s)
            return
        first, n = "1", self.snapshot_part
        for tier, hashes in blocks.items():
            name = _tier_name(tier)
            for i in range(0, len(hashes), n):
                await self._call("snapshot_part", [worker_id, self.ttl_s, first, name, _pack(hashes[i:i + n])],
                                 self.bulk_timeout_s)
                first = "0"
        await self._call("snapshot_end", [worker_id, self.ttl_s], self.bulk_timeout_s)

    async def longest_prefix(self, hashes: Sequence[int], tiers: Collection[Tier] | None = None) -> dict[str, int]:
        if not hashes:
            return {}
        mask = ALL_TIERS if tiers is None else tier_mask(tiers)
        out = await self._call("longest", [mask, _pack(hashes)])
        return {out[i]: int(out[i + 1]) for i in range(1, len(out), 2)}

    async def close(self) -> None:
        await self._r.aclose()

    async def _call(self, name: str, args: list, timeout_s: float | None = None):
        script = self._scripts[name]
        return await self.guard.run(
            lambda: script(args=[self.namespace, secrets.token_hex(8), *args]), name, timeout_s, self._epoch_changed
        )

    def _epoch_changed(self, result) -> bool:
        """True when Redis restarted empty (or was flushed) since our last call: its entries are gone."""
        epoch = result[0] if isinstance(result, list) else result
        changed = self._epoch is not None and epoch != self._epoch
        self._epoch = epoch
        return changed


def _tier_name(tier: str) -> str:
    if tier not in TIER_BITS:
        raise ValueError(f"unknown tier {tier!r}; known: {sorted(TIER_BITS)}")
    return tier
