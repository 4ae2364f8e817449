"""What each llama-server slot holds, as far as Pulse sent it: slot choice for prefix affinity, block events.

llama-server keeps a slot's KV after a request ends and reuses the common prefix with the next prompt
sent to that slot (`cache_prompt`). So Pulse sends a prompt to the idle slot whose last tokens share
the longest prefix with it, else to the least recently used one, and tells the prefix index which
blocks a slot now holds and which it dropped. A block two slots hold stays
published until neither holds it (reference counts).
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from cache.hashing import ROOT_HASH, block_hash, chain_hashes
from workers.protocol import BlockEvent, BlockSink


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    # Compare in strides first: prompts share thousands of tokens and this is on the request path.
    while i + 64 <= n and a[i : i + 64] == b[i : i + 64]:
        i += 64
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Slot:
    index: int
    tokens: list[int] = field(default_factory=list)  # what its KV holds (prompt + generated so far)
    hashes: list[int] = field(default_factory=list)  # chain hashes of its full blocks
    busy: bool = False
    last_used: float = 0.0
    epoch: int = 0  # bumped when the process restarts: a release from before then is stale


class SlotTable:
    def __init__(self, n_slots: int, block_size: int, sink: BlockSink | None = None, tier: str = "gpu",
                 root: int = ROOT_HASH):
        self.block_size, self.sink, self.tier = block_size, sink, tier
        self.root = root  # the model's chain root (ModelInfo.chain_root.hash): the first block's parent
        self.slots = [Slot(i) for i in range(n_slots)]
        self._refs: Counter[int] = Counter()

    def choose(self, prompt: list[int]) -> int | None:
        """The idle slot sharing the longest prefix (at least one block) with `prompt`, else the least
        recently used idle slot (empty ones first); None when all are busy (llama-server then queues the
        request, and only its final event names the slot it used)."""
        return self.best(prompt)[0]

    def best(self, prompt: list[int]) -> tuple[int | None, int]:
        """`choose`'s slot and how many leading tokens of `prompt` it holds (0 on a miss)."""
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            return None, 0
        best, best_len = None, self.block_size - 1
        for s in idle:
            if (n := common_prefix(s.tokens, prompt)) > best_len:
                best, best_len = s.index, n
        return (best, best_len) if best is not None else (self.least_recent(), 0)

    def least_recent(self) -> int | None:
        """The least recently used idle slot (empty ones first), or None when all are busy."""
        idle = [s for s in self.slots if not s.busy]
        return min(idle, key=lambda s: s.last_used).index if idle else None

    def acquire(self, index: int, prompt: list[int], hashes: list[int] | None = None) -> int:
        """Slot `index` now runs `prompt` (`hashes`: its chain hashes, if the caller has them); returns the
        epoch to pass to `release`."""
        slot = self.slots[index]
        slot.busy = True
        slot.last_used = time.monotonic()
        if hashes is None:
            # Hashing costs ~0.25 ms per 1k tokens: reuse the hashes of the blocks the slot already shares.
            bs = self.block_size
            keep = min(common_prefix(slot.tokens, prompt) // bs, len(slot.hashes))
            parent = slot.hashes[keep - 1] if keep else self.root
            hashes = slot.hashes[:keep] + chain_hashes(prompt[keep * bs :], bs, parent)
        self._replace(slot, list(prompt), list(hashes))
        return slot.epoch

    def reserve(self, index: int) -> int:
        """Mark slot `index` busy without changing what it holds (while it is saved or restored), so no
        request is sent to it meanwhile; returns its epoch. `unreserve` ends it."""
        slot = self.slots[index]
        slot.busy = True
        return slot.epoch

    def unreserve(self, index: int, epoch: int) -> None:
        slot = self.slots[index]
        if slot.epoch == epoch:
            slot.busy = False

    def load(self, index: int, tokens: list[int], hashes: list[int]) -> None:
        """Slot `index` now holds `tokens` (a checkpoint was restored into it); it stays busy."""
        self._replace(self.slots[index], list(tokens), list(hashes))

    def release(self, index: int, epoch: int, generated: list[int], failed: bool = False) -> None:
        """The request on slot `index` ended; its KV now also holds the generated tokens (all but the
        last, which was sampled and never evaluated). `failed`: what the slot holds is unknown."""
        slot = self.slots[index]
        if slot.epoch != epoch:
            return
        slot.busy = False
        slot.last_used = time.monotonic()
        if failed:
            self._replace(slot, [], [])
            return
        held = slot.tokens + generated[:-1]
        bs = self.block_size
        parent = slot.hashes[-1] if slot.hashes else self.root
        more = []
        for start in range(len(slot.hashes) * bs, len(held) - bs + 1, bs):
            parent = block_hash(parent, held[start : start + bs])
            more.append(parent)
        self._replace(slot, held, slot.hashes + more)

    def reset(self) -> None:
        """The process died: every slot is empty, and releases from before now are ignored."""
        for slot in self.slots:
            self._replace(slot, [], [])
            slot.busy = False
            slot.epoch += 1

    def used_blocks(self) -> int:
        return sum(-(-len(s.tokens) // self.block_size) for s in self.slots)

    def _replace(self, slot: Slot, tokens: list[int], hashes: list[int]) -> None:
        keep = 0
        while keep < min(len(slot.hashes), len(hashes)) and slot.hashes[keep] == hashes[keep]:
            keep += 1
        evicted, added = [], []
        for h in slot.hashes[keep:]:
            self._refs[h] -= 1
            if self._refs[h] <= 0:
                del self._refs[h]
                evicted.append(h)
        for h in hashes[keep:]:
            self._refs[h] += 1
            if self._refs[h] == 1:
                added.append(h)
        slot.tokens, slot.hashes = tokens, hashes
        if self.sink is not None:
            if evicted:
                self.sink(BlockEvent(kind="evicted", hashes=evicted, tier=self.tier))
            if added:
                self.sink(BlockEvent(kind="added", hashes=added, tier=self.tier))
