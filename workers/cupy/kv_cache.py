"""Paged KV cache: the device arrays, and the block bookkeeping with content-addressed prefix reuse.

K/V live in fixed-size blocks; a sequence's block table lists its blocks in order. A block that is full
is named by its chain hash (cache.hashing: parent hash + its tokens), the same hash the router computes,
so a new request whose prompt starts with cached blocks attaches them (reference counted) instead of
recomputing them. A block is reused only when its chain key (cache.hashing.chain_key: BLAKE2b-128 over the
parent's key and its tokens) matches as well, so it is the same whole prefix, not only the same hash.
Blocks nobody references but that still hold a hashed prefix stay cached and are evicted least-recently-used
first, only when a fresh block is needed. Additions and evictions are reported to the block sink as
BlockEvents (the prefix index), once per engine step.

Two pools for models with sliding-window layers (Gemma 3: 5 of 6 layers see only the last 512 tokens):
- the global pool holds the global layers' K/V for every block of a context, as above;
- the local pool holds the sliding-window layers' K/V only for blocks a query can still read: the window
  behind the next position to compute, plus the blocks this step writes. A sequence's local table has the
  same logical index as its block table (block i = positions [i*bs, (i+1)*bs)), with -1 where a block slid
  out, so the attention kernels index both tables the same way. A block that slides out goes back to the
  local pool with its hash, among the blocks reclaimed first (oldest first): a later request can still use
  it until then, but it goes before the last window of any finished sequence, which later turns hit.
  Two windows of a running sequence go back young instead: the one behind its prompt's end and the one
  behind its hit point (the previous turn's prompt end). So every turn end of a conversation keeps its
  window in the LRU, and a turn that edits the middle of the history still hits at the last turn end before
  the edit (with only the newest turn end kept, such a turn hit the system prompt or nothing).
The same hash chain keys both pools. A prefix hit of L tokens needs global blocks for [0, L) and local
blocks for the window the first new query reads, [L - window + 1, L); match_prefix takes the longest L with
both. Block events describe the global pool: a global eviction ends a chain for good, while a local
eviction only shortens hits ending near that block (the LRU keeps the tails of recent chains, which is
where a continuing conversation hits), so reporting it would make the router under-count the usual hit.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from cache.hashing import ChainRoot, block_hash, chain_key, pack_tokens
from workers.cupy.sequence import Sequence
from workers.protocol import BlockEvent, BlockSink


class KVStorage:
    """K and V on the engine's device, one (blocks, block_size, kv_heads, head_dim) array per layer in `k` and
    `v`: views into one array per pool, (layers of the pool, blocks, ...). Without `is_global`, every layer
    is in one pool (one block table for all layers). `extra` blocks at the end of each pool are scratch."""

    def __init__(self, xp, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype="float32", *, is_global=None, num_local: int | None = None, extra: int = 0):
        is_global = [True] * n_layers if is_global is None else list(is_global)
        assert len(is_global) == n_layers
        n_global = sum(is_global)
        self.num_global, self.num_local = num_blocks, num_blocks if num_local is None else num_local
        self.two_pools = num_local is not None  # the sliding-window layers index their own block tables
        if num_local is None:  # one pool: local layers share the global layers' blocks
            is_global = [True] * n_layers
            n_global = n_layers

        def pool(n, blocks):  # zeros, not empty: padded attention reads of unused slots must not see NaN garbage
            shape = (n, blocks + extra, block_size, n_kv_heads, head_dim)
            k, v = xp.zeros(shape, dtype), xp.zeros(shape, dtype)
            if isinstance(k, np.ndarray):
                # NumPy's zeros maps pages lazily: the pool would be claimed block by block under load, the worker's
                # RSS growing for minutes (RELIABILITY.md, the real-model soak) and a box too small for it found
                # mid-run by the OOM killer rather than here. Writing it claims it now, as a GPU allocation does.
                k.fill(0)
                v.fill(0)
            return k, v

        self.global_k, self.global_v = pool(n_global, num_blocks)
        self.local_k, self.local_v = pool(n_layers - n_global, self.num_local)
        gi, li = iter(range(n_global)), iter(range(n_layers - n_global))
        index = [(True, next(gi)) if g else (False, next(li)) for g in is_global]
        self.k = [(self.global_k if g else self.local_k)[j] for g, j in index]
        self.v = [(self.global_v if g else self.local_v)[j] for g, j in index]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.global_k, self.global_v, self.local_k, self.local_v))

    @staticmethod
    def bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, itemsize: int = 4) -> int:
        return 2 * n_layers * n_kv_heads * head_dim * itemsize


@dataclass(frozen=True)
class PoolPlan:
    """Block counts of the two pools; window None: one pool (every layer uses the global block table)."""

    num_global: int
    num_local: int | None
    window: int | None


def plan_pools(num_blocks: int, block_size: int, is_global, window: int | None, max_num_seqs: int,
               max_step_tokens: int, enabled: bool = True) -> PoolPlan:
    """Split a budget of `num_blocks` all-layer blocks (the profile's KV tokens / block size) into the two
    pools, at the same bytes. The local pool gets what the running batch can hold at once (per sequence
    the window plus the blocks its position and a chunk straddle, window/bs + 3, plus the step's token
    budget) and a third of what the running batch leaves, for finished sequences' windows, which is what a
    prefix hit needs besides the global blocks; every other block goes to the global pool, n_layers /
    n_global times over. Sized for the running batch alone, a full batch reclaimed every cached window.
    Capped at max_num_seqs finished windows (8 on the H200 replay), it held fewer windows than two agent
    conversations have turn ends (14 each), and a turn that edits the middle of its history hits at the
    last turn end before the edit only while that turn end's window is cached (BlockManager._kept)."""
    is_global = list(is_global)
    n_layers, n_global = len(is_global), sum(is_global)
    if not enabled or not window or n_global in (0, n_layers):
        return PoolPlan(num_blocks, None, None)
    step = max(max_step_tokens, max_num_seqs)
    per_window = -(-window // block_size)
    running = max_num_seqs * (per_window + 3) + -(-step // block_size)
    # finished windows take a third of what the running batch leaves: a local block costs the global pool
    # n_layers_local / n_global blocks (5 for Gemma 3), so a small budget must not trade its context away
    finished = max(0, num_blocks - running) // 3
    local = min(num_blocks, running + finished)
    glob = (num_blocks * n_layers - local * (n_layers - n_global)) // n_global
    return PoolPlan(glob, local, window)


def plan_for(cfg, num_blocks: int, block_size: int, max_num_seqs: int, max_step_tokens: int,
             enabled: bool = True) -> PoolPlan:
    """plan_pools for a model config with `n_layers`, `is_global(layer)` and `window`."""
    return plan_pools(num_blocks, block_size, [cfg.is_global(i) for i in range(cfg.n_layers)],
                      getattr(cfg, "window", None), max_num_seqs, max_step_tokens, enabled)


@dataclass
class _Block:
    id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered in the prefix cache
    key: bytes | None = None  # chain_key of its whole prefix: rules out a hash collision on reuse


class _Pool:
    """One pool's blocks: free ones, cached (unreferenced, hashed; LRU order) ones, and the hash index."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks = [_Block(i) for i in range(num_blocks)]
        self.free: deque[int] = deque(range(num_blocks))  # unreferenced, holding nothing reusable
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # unreferenced but hashed; oldest first
        self.cold: OrderedDict[int, None] = OrderedDict()  # the same, reclaimed before any of cached_free
        self.by_hash: dict[int, int] = {}
        self.evicted: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.cold) + len(self.cached_free)

    def lookup(self, h: int, key: bytes) -> int | None:
        bid = self.by_hash.get(h)
        return bid if bid is not None and self.blocks[bid].key == key else None

    def ref(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            self.cached_free.pop(bid, None)
            self.cold.pop(bid, None)
        block.ref_count += 1

    def register(self, bid: int, h: int, key: bytes) -> bool:
        """Name a full block by its hash; False when the hash is already cached (the first copy stays)."""
        block = self.blocks[bid]
        if h in self.by_hash or block.hash is not None:
            return False
        block.hash, block.key = h, key
        self.by_hash[h] = bid
        return True

    def release(self, bid: int, cold: bool = False) -> None:
        """Drop one reference. A hashed block stays cached: at the LRU's young end, or with `cold` among
        the blocks reclaimed first, oldest first (a local block that slid out of a running window)."""
        block = self.blocks[bid]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                (self.cold if cold else self.cached_free)[bid] = None
            else:
                self.free.append(bid)

    def take(self) -> int:
        if self.free:
            bid = self.free.popleft()
        else:
            bid, _ = (self.cold or self.cached_free).popitem(last=False)
            block = self.blocks[bid]
            del self.by_hash[block.hash]
            self.evicted.append(block.hash)
            block.hash, block.key = None, None
        self.blocks[bid].ref_count = 1
        return bid


class BlockTables:
    """The running sequences' block tables as rows of one NumPy array per pool, kept by BlockManager beside
    the sequences' lists (which stay the truth for Python code), so an engine step takes the whole batch's
    tables in one gather (batch.build_batch) instead of flattening every list again. At 256 decoding
    sequences of ~200 tokens, flattening both pools' lists was ~320 of build_batch's ~660 us on the dev
    box, and it grows with the context (a fromiter over every block of every sequence, ~36 ns a block).

    A sequence gets a row with its first block (`seq.table_row`) and gives it back when freed. Past a row's
    length both arrays hold 0 (the padding build_batch's tables always had); `local` holds -1 where a block
    slid out, as the sequence's local_table does."""

    def __init__(self, two_pools: bool, rows: int = 16, width: int = 32):
        self.glob = np.zeros((rows, width), np.int32)
        self.local = np.zeros((rows, width), np.int32) if two_pools else None
        self.lens = np.zeros(rows, np.int64)
        self._free_rows = list(range(rows - 1, -1, -1))

    def row_of(self, seq: Sequence) -> int:
        if seq.table_row < 0:
            if not self._free_rows:
                self._grow(rows=2 * self.lens.size)
            seq.table_row = self._free_rows.pop()
        return seq.table_row

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        old_rows, old_width = self.glob.shape
        rows, width = rows or old_rows, width or old_width

        def grown(a):
            out = np.zeros((rows, width), a.dtype)
            out[:old_rows, :old_width] = a
            return out
        self.glob = grown(self.glob)
        if self.local is not None:
            self.local = grown(self.local)
        lens = np.zeros(rows, np.int64)
        lens[:old_rows] = self.lens
        self.lens = lens
        self._free_rows[:0] = range(rows - 1, old_rows - 1, -1)  # popped from the end: old free rows first

    def set_row(self, seq: Sequence) -> None:
        """Copy `seq`'s whole lists into its row (a prefix match attached many blocks at once)."""
        row, n = self.row_of(seq), len(seq.block_table)
        if n > self.glob.shape[1]:
            self._grow(width=max(n, 2 * self.glob.shape[1]))
        self.glob[row, :n] = seq.block_table
        self.glob[row, n:] = 0
        if self.local is not None:
            self.local[row, :n] = seq.local_table
            self.local[row, n:] = 0
        self.lens[row] = n

    def append(self, seq: Sequence) -> None:
        """`seq`'s lists each grew by one block."""
        row, i = self.row_of(seq), len(seq.block_table) - 1
        if i >= self.glob.shape[1]:
            self._grow(width=2 * self.glob.shape[1])
        self.glob[row, i] = seq.block_table[i]
        if self.local is not None:
            self.local[row, i] = seq.local_table[i]
        self.lens[row] = i + 1

    def slid_out(self, seq: Sequence, start: int, end: int) -> None:
        self.local[seq.table_row, start:end] = -1

    def truncate(self, seq: Sequence, keep: int) -> None:
        """Blocks from `keep` on left `seq` (zeros from there, as past any row's end)."""
        if seq.table_row >= 0:
            self.glob[seq.table_row, keep:] = 0
            if self.local is not None:
                self.local[seq.table_row, keep:] = 0
            self.lens[seq.table_row] = min(keep, int(self.lens[seq.table_row]))

    def release(self, seq: Sequence) -> None:
        if seq.table_row >= 0:
            self.truncate(seq, 0)
            self._free_rows.append(seq.table_row)
            seq.table_row = -1


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, block_sink: BlockSink | None = None,
                 num_local: int | None = None, window: int | None = None, root: ChainRoot = ChainRoot()):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.root = root  # the model's chain root (ModelInfo.chain_root): its blocks' hashes and keys start here
        self.glob = _Pool(num_blocks)
        self.local = _Pool(num_local) if window and num_local is not None else None
        self.window = window if self.local is not None else None
        self._sink = block_sink
        self._added: list[int] = []
        # per running sequence, the local blocks match_prefix attached (the window behind its hit point)
        self._hit_windows: dict[Sequence, range] = {}
        self.tables = BlockTables(two_pools=self.local is not None)

    @classmethod
    def from_plan(cls, plan: PoolPlan, block_size: int, block_sink: BlockSink | None = None,
                  root: ChainRoot = ChainRoot()) -> BlockManager:
        return cls(plan.num_global, block_size, block_sink, plan.num_local, plan.window, root)

    @property
    def num_free(self) -> int:
        return self.glob.num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self.glob.by_hash)

    @property
    def num_local_used(self) -> int:
        return 0 if self.local is None else self.local.num_blocks - self.local.num_free

    @property
    def pressure_used(self) -> int:
        """Used blocks as the worker reports them (of num_blocks): the fuller pool's share, so free
        capacity is never over-stated when the running batch fills the local pool first."""
        if self.local is None or not self.local.num_blocks:
            return self.num_used
        return max(self.num_used, -(-self.num_local_used * self.num_blocks // self.local.num_blocks))

    def first_needed(self, pos: int) -> int:
        """The first block a query at `pos` reads on sliding-window layers."""
        return max(0, pos - self.window + 1) // self.block_size

    def match_prefix(self, seq: Sequence) -> int:
        """Attach the cached blocks that start `seq`'s tokens; returns the tokens they cover.

        At least one token is always left to compute: the next token needs its logits.
        """
        assert not seq.block_table, "prefix matching is for a sequence without blocks"
        bs, (parent, key), chain = self.block_size, self.root, []
        for i in range((len(seq.token_ids) - 1) // bs):
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            h = block_hash(parent, tokens)
            key = chain_key(key, pack_tokens(tokens))
            if self.glob.lookup(h, key) is None:
                break
            chain.append((h, key))
            parent = h
        n = self._local_hit(chain) if self.local is not None else len(chain)
        for h, tokens in chain[:n]:
            bid = self.glob.by_hash[h]
            self.glob.ref(bid)
            seq.block_table.append(bid)
            seq.block_hashes.append(h)
        if self.local is not None:
            first = self.first_needed(n * bs)
            seq.local_table = [-1] * first
            for h, _ in chain[first:n]:
                bid = self.local.by_hash[h]
                self.local.ref(bid)
                seq.local_table.append(bid)
            seq.local_start = first
            self._hit_windows[seq] = range(first, n)
        self.tables.set_row(seq)
        seq.num_computed = n * bs
        return seq.num_computed

    def _local_hit(self, chain: list) -> int:
        """The most blocks of `chain` (all in the global pool) whose local window is cached too."""
        run = 0  # cached local blocks ending at block i
        best = 0
        for i, (h, key) in enumerate(chain):
            run = run + 1 if self.local.lookup(h, key) is not None else 0
            if run >= i + 1 - self.first_needed((i + 1) * self.block_size):
                best = i + 1
        return best

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.can_take(self.blocks_needed(seq, num_new_tokens))

    def can_take(self, need: int) -> bool:
        """Whether `need` new blocks (one per pool) are free."""
        return need <= self.glob.num_free and (self.local is None or need <= self.local.num_free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give `seq` blocks for its next `num_new_tokens` tokens (check can_allocate first)."""
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self.glob.take())
            if self.local is not None:
                seq.local_table.append(self.local.take())
            self.tables.append(seq)

    def commit_steps(self, seqs) -> None:
        """commit_full_blocks for each of `seqs` after a step, called only where it has work: a block filled, or
        a local block slid out of the window (one step in 16; the call per sequence per step cost more than the
        check)."""
        bs, local = self.block_size, self.local
        window = self.window if local is not None else 0
        for seq in seqs:
            n = seq.num_computed
            # first_needed(n), inline (without its max(0, ...): a negative start floors below local_start >= 0)
            if n // bs > len(seq.block_hashes) or (local is not None and (n - window + 1) // bs > seq.local_start):
                self.commit_full_blocks(seq)

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that this step filled, so later requests can reuse them; then give back
        the local blocks no later query of `seq` reads."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed // bs):  # usually none: a block per 16 tokens
            parent = seq.block_hashes[-1] if seq.block_hashes else self.root.hash
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            h = block_hash(parent, tokens)
            # the parent's key sits on the sequence's own global block for i - 1 (set below even when that
            # block was a duplicate and not registered), so no per-sequence list of keys is kept
            parent_key = self.glob.blocks[seq.block_table[i - 1]].key if i else self.root.key
            key = chain_key(parent_key, pack_tokens(tokens))
            seq.block_hashes.append(h)
            self.glob.blocks[seq.block_table[i]].key = key
            # the same content computed twice (two requests in one step): the first copy is the cached one
            if self.glob.register(seq.block_table[i], h, key):
                self._added.append(h)
            if self.local is not None and seq.local_table[i] >= 0:
                self.local.register(seq.local_table[i], h, key)
        # most steps nothing slid out (a block per 16 tokens): checked here, not by a call to _slide
        if self.local is not None and self.first_needed(seq.num_computed) > seq.local_start:
            self._slide(seq)

    def _slide(self, seq: Sequence) -> None:
        """Release local blocks before the window of the next position to compute, cold: the LRU reclaims
        them before any finished sequence's last window (the tail a continuing request hits). Released at
        the young end instead, one long prefill (a 9k-token agent prompt slides ~540 blocks out) flushed
        every cached window from a local pool sized for the running batch: on the H200 routing replay
        later turns of a conversation then found no usable prefix at all.

        Two windows go back young (`_kept`): behind the prompt's end, and behind the hit point."""
        end = min(self.first_needed(seq.num_computed), len(seq.local_table))
        kept = self._kept(seq)
        for i in range(seq.local_start, end):
            if seq.local_table[i] >= 0:
                self.local.release(seq.local_table[i], cold=not any(i in r for r in kept))
                seq.local_table[i] = -1
        if seq.local_start < end:
            self.tables.slid_out(seq, seq.local_start, end)
        seq.local_start = max(seq.local_start, end)

    def _kept(self, seq: Sequence) -> tuple[range, range]:
        """The local blocks of `seq` that stay young when they slide out.
        - The window behind the prompt's last full block: the next turn of a conversation resends this prompt
          and hits there when it does not carry the generated text token for token (an agent's edited answer,
          a tool call re-rendered by the client).
        - The window behind the hit point, which is the previous turn's prompt end: a later turn that edits
          the history after that point hits there. Cold, only the newest turn end of a conversation stayed
          cached: replaying the H200 14-turn trace through this class (bench/window_hits.py, 672 local
          blocks a worker), edited turns recomputed 7,420 prompt tokens each; kept young, 5,188 (an oracle
          cache: 4,356).
        Blocks past them (generated text sliding out of a long answer, the middle of a prompt) go cold."""
        prompt_end = seq.num_prompt_tokens // self.block_size
        return (range(self.first_needed(prompt_end * self.block_size), prompt_end),
                self._hit_windows.get(seq, range(0)))

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Release `seq`'s blocks past the first `num_tokens` tokens (speculation's rejected drafts). Those
        blocks were never full with committed tokens, so they hold nothing worth caching."""
        keep = -(-num_tokens // self.block_size)
        for bid in seq.block_table[keep:]:
            self.glob.release(bid)
        del seq.block_table[keep:]
        if self.local is not None:
            for bid in seq.local_table[keep:]:
                if bid >= 0:
                    self.local.release(bid)
            del seq.local_table[keep:]
        self.tables.truncate(seq, keep)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Its hashed blocks stay cached; global tail blocks are evicted first
        (a chain is useless past its first gap), local ones last (a later hit needs the chain's tail)."""
        for bid in reversed(seq.block_table):
            self.glob.release(bid)
        if self.local is not None:
            for bid in seq.local_table:
                if bid >= 0:
                    self.local.release(bid)
        seq.block_table, seq.block_hashes, seq.num_computed = [], [], 0
        seq.local_table, seq.local_start = [], 0
        self.tables.release(seq)
        self._hit_windows.pop(seq, None)

    def cached_hashes(self) -> list[int]:
        """Every hashed block of the global pool (referenced or cached): what the block events have announced and
        not withdrawn, for the prefix index's snapshots. Safe from another thread (one C-level copy of the keys)."""
        return list(self.glob.by_hash)

    def flush_events(self) -> None:
        """Send this step's evictions, then additions, to the block sink (a hash may leave and come back)."""
        evicted = self.glob.evicted
        if self._sink is not None:
            if evicted:
                self._sink(BlockEvent(kind="evicted", hashes=evicted))
            if self._added:
                self._sink(BlockEvent(kind="added", hashes=self._added))
        self._added, self.glob.evicted = [], []
        if self.local is not None:
            self.local.evicted = []
