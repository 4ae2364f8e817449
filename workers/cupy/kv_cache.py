"""Paged KV cache: the device arrays, and the block bookkeeping with content-addressed prefix reuse.

K/V live in fixed-size blocks; a sequence's block table lists its blocks in order. A block that is full
is named by its chain hash (cache.hashing: parent hash + its tokens), the same hash the router computes,
so a new request whose prompt starts with cached blocks attaches them (reference counted) instead of
recomputing them. Blocks nobody references but that still hold a hashed prefix stay cached and are
evicted least-recently-used first, only when a fresh block is needed. Additions and evictions are
reported to the block sink as BlockEvents (the prefix index), once per engine step.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from cache.hashing import ROOT_HASH, block_hash
from workers.cupy.sequence import Sequence
from workers.protocol import BlockEvent, BlockSink


class KVStorage:
    """K and V arrays, each (layers, blocks, block_size, kv_heads, head_dim), on the engine's device."""

    def __init__(self, xp, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype="float32"):
        shape = (n_layers, num_blocks, block_size, n_kv_heads, head_dim)
        # zeros, not empty: padded attention reads of unused slots must not see NaN garbage
        self.k = xp.zeros(shape, dtype)
        self.v = xp.zeros(shape, dtype)

    @staticmethod
    def bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, itemsize: int = 4) -> int:
        return 2 * n_layers * n_kv_heads * head_dim * itemsize


@dataclass
class _Block:
    id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered in the prefix cache
    tokens: tuple[int, ...] | None = None  # its tokens, to rule out a hash collision on reuse


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, block_sink: BlockSink | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # unreferenced, holding nothing reusable
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # unreferenced but hashed; oldest first
        self._by_hash: dict[int, int] = {}
        self._sink = block_sink
        self._added: list[int] = []
        self._evicted: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached_free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    def match_prefix(self, seq: Sequence) -> int:
        """Attach the cached blocks that start `seq`'s tokens; returns the tokens they cover.

        At least one token is always left to compute: the next token needs its logits.
        """
        assert not seq.block_table, "prefix matching is for a sequence without blocks"
        bs, parent = self.block_size, ROOT_HASH
        for i in range((len(seq.token_ids) - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens)
            bid = self._by_hash.get(h)
            if bid is None or self._blocks[bid].tokens != tokens:
                break
            self._ref(bid)
            seq.block_table.append(bid)
            seq.block_hashes.append(h)
            parent = h
        seq.num_computed = len(seq.block_table) * bs
        return seq.num_computed

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give `seq` blocks for its next `num_new_tokens` tokens (check can_allocate first)."""
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._take())

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that this step filled, so later requests can reuse them."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens)
            seq.block_hashes.append(h)
            block = self._blocks[seq.block_table[i]]
            # the same content computed twice (two requests in one step): the first copy is the cached one
            if h not in self._by_hash and block.hash is None:
                block.hash, block.tokens = h, tokens
                self._by_hash[h] = block.id
                self._added.append(h)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Release `seq`'s blocks past the first `num_tokens` tokens (speculation's rejected drafts). Those
        blocks were never full with committed tokens, so they hold nothing worth caching."""
        keep = -(-num_tokens // self.block_size)
        for bid in seq.block_table[keep:]:
            block = self._blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free.append(bid)
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Its hashed blocks stay cached; the tail blocks are evicted first."""
        for bid in reversed(seq.block_table):
            block = self._blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self._cached_free[bid] = None
                else:
                    self._free.append(bid)
        seq.block_table, seq.block_hashes, seq.num_computed = [], [], 0

    def flush_events(self) -> None:
        """Send this step's evictions, then additions, to the block sink (a hash may leave and come back)."""
        if self._sink is not None:
            if self._evicted:
                self._sink(BlockEvent(kind="evicted", hashes=self._evicted))
            if self._added:
                self._sink(BlockEvent(kind="added", hashes=self._added))
        self._added, self._evicted = [], []

    def _ref(self, bid: int) -> None:
        block = self._blocks[bid]
        if block.ref_count == 0:
            self._cached_free.pop(bid, None)
        block.ref_count += 1

    def _take(self) -> int:
        if self._free:
            bid = self._free.popleft()
        else:
            bid, _ = self._cached_free.popitem(last=False)
            block = self._blocks[bid]
            del self._by_hash[block.hash]
            self._evicted.append(block.hash)
            block.hash, block.tokens = None, None
        self._blocks[bid].ref_count = 1
        return bid
