"""The PrefixIndex plug point: which worker holds which KV blocks, and in which tier.

Contract (tests/integration/test_redis_index.py runs it against both implementations):
- Blocks are named by their chain hash (cache.hashing.chain_hashes), so a block's hash names the whole
  prefix up to it. An entry says "worker W holds block H in tier T"; one worker may hold one block in
  several tiers (GPU KV, host RAM, a saved checkpoint).
- `publish(worker_id, hashes, tier)`: W now holds these blocks in `tier`; refreshes their expiry.
- `evict(worker_id, hashes, tier=None)`: W dropped them from `tier` (None: from every tier).
  Unknown entries are ignored.
- `drop_worker(worker_id)`: forget everything W held (it died, restarted or was drained).
- `snapshot(worker_id, blocks_by_tier)`: replace W's whole entry set at once. Workers call it when they
  start, periodically (well inside the TTL), and when `on_recovered` fires (the index lost events or
  its contents), so the index refills from the source of truth.
- `longest_prefix(hashes, tiers=None) -> {worker_id: matched_blocks}`: for each worker, how many
  leading blocks of `hashes` it holds without a gap (in any of `tiers`; None: any tier). Workers with
  no match are absent. One round trip to the store.
- Expiry is a safety net behind explicit evictions, per worker: a worker's entries lapse `ttl_s` after
  its last publish, evict or snapshot, so a worker that died silently stops attracting requests; a
  single eviction lost while the store was away is repaired by the snapshot `on_recovered` asks for
  (and by the worker's periodic snapshot).
- Store failures raise `IndexUnavailable` quickly (the Redis timeout); the caller routes on load alone.
- `close()` releases connections; safe to call twice.
All methods are coroutines; implementations are safe to share among the tasks of one event loop.
"""
from __future__ import annotations

import abc
from collections.abc import Collection, Mapping, Sequence
from typing import Literal

Tier = Literal["gpu", "host", "checkpoint"]
TIER_BITS: dict[str, int] = {"gpu": 1, "host": 2, "checkpoint": 4}
ALL_TIERS = 7


class IndexUnavailable(Exception):
    """The index could not answer in time (store down, slow, or recently failed). Route on load only."""


def tier_mask(tiers: Collection[str] | str | None) -> int:
    """Bit mask of tier names; None means every tier."""
    if tiers is None:
        return ALL_TIERS
    if isinstance(tiers, str):
        tiers = (tiers,)
    try:
        return sum({TIER_BITS[t] for t in tiers})
    except KeyError as e:
        raise ValueError(f"unknown tier {e.args[0]!r}; known: {sorted(TIER_BITS)}") from None


class PrefixIndex(abc.ABC):
    """Which worker holds which prefix blocks. See the module docstring for the contract."""

    @abc.abstractmethod
    async def publish(self, worker_id: str, hashes: Sequence[int], tier: Tier = "gpu") -> None: ...

    @abc.abstractmethod
    async def evict(self, worker_id: str, hashes: Sequence[int], tier: Tier | None = None) -> None: ...

    @abc.abstractmethod
    async def drop_worker(self, worker_id: str) -> None: ...

    @abc.abstractmethod
    async def snapshot(self, worker_id: str, blocks: Mapping[Tier, Sequence[int]]) -> None: ...

    @abc.abstractmethod
    async def longest_prefix(
        self, hashes: Sequence[int], tiers: Collection[Tier] | None = None
    ) -> dict[str, int]: ...

    async def apply(self, worker_id: str, kind: str, hashes: Sequence[int], tier: Tier = "gpu") -> None:
        """Apply one block event (workers.protocol.BlockEvent's kind/hashes/tier)."""
        if kind == "added":
            await self.publish(worker_id, hashes, tier)
        elif kind == "evicted":
            await self.evict(worker_id, hashes, tier)
        else:
            raise ValueError(f"unknown block event kind {kind!r}")

    def held(self) -> dict[str, int] | None:
        """Blocks indexed per worker, when the index can tell without a round trip (the status page shows
        it); None when it cannot."""
        return None

    async def close(self) -> None:
        return None
