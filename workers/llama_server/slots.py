"""What each llama-server slot holds, as far as Pulse sent it: slot choice for prefix affinity, block events.

llama-server keeps a slot's KV after a request ends and reuses the common prefix with the next prompt
sent to that slot (`cache_prompt`). So Pulse sends a prompt to the idle slot whose last tokens share
the longest prefix with it, else to the least recently used one, and tells the prefix index which
blocks a slot now holds and which it dropped. A block two slots hold stays
published until neither holds it (reference counts).

Pulse sends a request to a slot only when it knows that slot is idle. A request sent with no slot (all were
busy) waits in llama-server's queue and takes whichever slot frees first; Pulse learns which only from its first
event, after its prompt was evaluated. Until then any slot Pulse counts idle may already be that request's, and a
request sent to a busy slot waits for that very slot to end its generation (llama-server defers it, and a release
hands the slot to a deferred request before any queued one). So while such unplaced requests exist, new ones go
without a slot too, in arrival order, as they would to llama-server alone. Pinning them instead kept 8 clients on
4 slots in fixed pairs that launched in smaller groups, each launch a prompt step the rest wait out (2-core box,
2026-12-06: 1,481 deferred picks in one parity run). A slot counts its holders, not a flag: a request llama-server
placed there may start before Pulse reads the end of the one before it.

The other way round: a request sent to an idle slot and one sent just after it with no slot travel over separate
connections, and the second can reach llama-server first and take that slot (its own pick prefers the slot holding
the same prefix). So a request with no slot is held until every request sent to a named slot has started (its
first event), at most `NAMED_HOLD_S`: by then a named request has long reached llama-server's queue, ahead of it.
It is held only when every slot was busy, so it would queue in llama-server anyway; a named request it overtook
waits out a whole generation (an H100 machine, 16 slots, 32 clients at temperature 1: one deferred pick in a run of
64 requests whose TTFT p99 was 6.7 s over direct's, a generation being ~6.5 s there).

The same race across the hand-over from the gateway's queue: when a wave of generations ends, the gateway sends
the worker many requests at once, more than the slots left free. Those sent while a slot was free expect to launch;
those sent beyond the slots (every slot has a request) wait in llama-server's own deferred list, which it pops one
request per slot released. Over separate connections one of the newest could reach a free slot first and leave one
of the oldest, already long in the gateway's queue, to the deferred list for a whole generation more (read in
llama-server's log on the 2-core box, 16 slots, 32 clients: a TTFT of 6.9 s against a p90 of 4.4 s), where
llama-server called directly keeps arrival order in its one list. So a request sent beyond the slots is also held
until the ones sent with no slot before it to a free one are placed, within the same `NAMED_HOLD_S`: it waits for a
release anyway. (A TTFT p99 tail of ~2x direct's at 32-64 clients on an H100 machine outlived this hold: its cause
is not known yet; BENCHMARKS.md, issue 18.)
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

from cache.hashing import ROOT_HASH, block_hash, chain_hashes
from workers.protocol import BlockEvent, BlockSink

NAMED_HOLD_S = 0.1  # the longest a request with no slot waits for the ones sent before it that it could overtake


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
    holders: int = 0  # requests on it (or sent to it) that have not ended
    reserved: bool = False  # held for a checkpoint save or restore
    owner: int = 0  # the ticket of the request whose prompt `tokens` holds
    last_used: float = 0.0
    epoch: int = 0  # bumped when the process restarts: a reservation from before then is stale

    @property
    def busy(self) -> bool:
        return self.holders > 0 or self.reserved


class SlotTable:
    def __init__(self, n_slots: int, block_size: int, sink: BlockSink | None = None, tier: str = "gpu",
                 root: int = ROOT_HASH):
        self.block_size, self.sink, self.tier = block_size, sink, tier
        self.root = root  # the model's chain root (ModelInfo.chain_root.hash): the first block's parent
        self.slots = [Slot(i) for i in range(n_slots)]
        self._refs: Counter[int] = Counter()
        self.unplaced = 0  # requests sent with no slot whose slot is not known yet (`sent_unplaced`, `placed`)
        self.named = 0  # requests sent to a named slot that have not started yet (`sent_named`, `started`)
        self._named_started = asyncio.Event()
        self._named_started.set()
        self.launching = 0  # of the unplaced, those sent while a slot was free (`sent_unplaced(beyond=False)`)
        self._launched = asyncio.Event()
        self._launched.set()
        self._tickets = itertools.count(1)
        self._valid_from = 0  # tickets below this were issued before the last reset

    def choose(self, prompt: list[int]) -> int | None:
        """The idle slot sharing the longest prefix (at least one block) with `prompt`, else the least
        recently used idle slot (empty ones first); None when all are busy or a request sent with no slot is
        not placed yet (llama-server then queues the request, and its first event names the slot it got)."""
        return self.best(prompt)[0]

    def best(self, prompt: list[int]) -> tuple[int | None, int]:
        """`choose`'s slot and how many leading tokens of `prompt` it holds (0 on a miss)."""
        idle = [s for s in self.slots if not s.busy]
        if not idle or self.unplaced:
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

    def sent_unplaced(self, beyond: bool = False) -> None:
        """A request went to llama-server with no slot: until `placed`, no slot is chosen for others. `beyond`:
        every slot had a request already, so it waits in llama-server's own queue; one sent while a slot was free
        expects to launch at once, and until it is placed requests sent beyond the slots are held (`named_ahead`)."""
        self.unplaced += 1
        if not beyond:
            self.launching += 1
            self._launched.clear()

    def placed(self, beyond: bool = False) -> None:
        """A request sent with no slot (`beyond`, as it was sent) got one (its first event named it), or ended
        without one."""
        self.unplaced = max(0, self.unplaced - 1)
        if not beyond:
            self.launching = max(0, self.launching - 1)
            if not self.launching:
                self._launched.set()

    def sent_named(self) -> None:
        """A request goes to the slot `choose` named: until `started`, requests with no slot are held."""
        self.named += 1
        self._named_started.clear()

    def started(self) -> None:
        """A request sent to a named slot started (its first event came), or ended before."""
        self.named = max(0, self.named - 1)
        if not self.named:
            self._named_started.set()

    async def named_ahead(self, hold_s: float = NAMED_HOLD_S, beyond: bool = False) -> None:
        """Wait until every request sent to a named slot has started and, for a request sent `beyond` the slots,
        every one sent with no slot to a free slot has been placed: at most `hold_s` in all."""
        if not (self.named or (beyond and self.launching)):
            return

        async def ahead_gone() -> None:
            while self.named or (beyond and self.launching):
                await self._named_started.wait()
                if beyond:
                    await self._launched.wait()

        try:
            await asyncio.wait_for(ahead_gone(), hold_s)
        except asyncio.TimeoutError:
            pass

    def acquire(self, index: int, prompt: list[int], hashes: list[int] | None = None) -> int:
        """Slot `index` now runs `prompt` (`hashes`: its chain hashes, if the caller has them); returns the
        ticket to pass to `release`. A reservation of the slot becomes this hold."""
        slot = self.slots[index]
        slot.holders += 1
        slot.reserved = False
        slot.owner = ticket = next(self._tickets)
        slot.last_used = time.monotonic()
        if hashes is None:
            # Hashing costs ~0.25 ms per 1k tokens: reuse the hashes of the blocks the slot already shares.
            bs = self.block_size
            keep = min(common_prefix(slot.tokens, prompt) // bs, len(slot.hashes))
            parent = slot.hashes[keep - 1] if keep else self.root
            hashes = slot.hashes[:keep] + chain_hashes(prompt[keep * bs :], bs, parent)
        self._replace(slot, list(prompt), list(hashes))
        return ticket

    def reserve(self, index: int) -> int:
        """Mark slot `index` busy without changing what it holds (while it is saved or restored), so no
        request is sent to it meanwhile; returns its epoch. `unreserve` (or `acquire`) ends it."""
        slot = self.slots[index]
        slot.reserved = True
        return slot.epoch

    def unreserve(self, index: int, epoch: int) -> None:
        slot = self.slots[index]
        if slot.epoch == epoch:
            slot.reserved = False

    def load(self, index: int, tokens: list[int], hashes: list[int]) -> None:
        """Slot `index` now holds `tokens` (a checkpoint was restored into it); it stays busy."""
        self._replace(self.slots[index], list(tokens), list(hashes))

    def release(self, index: int, ticket: int, generated: list[int], failed: bool = False) -> None:
        """The request on slot `index` (`ticket`: from its `acquire`) ended; its KV now also holds the generated
        tokens (all but the last, which was sampled and never evaluated). `failed`: what the slot holds is
        unknown. If a later request holds the slot already, what it holds is that one's prompt."""
        slot = self.slots[index]
        if ticket < self._valid_from:
            return
        slot.holders = max(0, slot.holders - 1)
        slot.last_used = time.monotonic()
        if slot.owner != ticket:
            return
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
            slot.holders, slot.reserved = 0, False
            slot.epoch += 1
        self._valid_from = next(self._tickets)

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
