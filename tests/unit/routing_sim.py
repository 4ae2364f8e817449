"""A small discrete-event model of an agent fleet on N workers, to check routing policy, not to time it.

Each worker has `slots` slots, a FIFO queue, and an LRU KV cache of `kv_blocks` blocks. A request's
time to first token is its wait for a slot plus the prefill of its uncached blocks; it then holds the
slot for its decode. Sessions share a system prompt, grow their context every turn, and now and then
edit the middle of it (the blocks after the edit change). The router sees exact prefix hits (the
index is fresh in this model) and each worker's load, as the gateway would.

Real figures come from bench/ against real workers; this model only shows that the policy's decisions
have the intended shape (hits close to an oracle's, no hot spot, miss -> least loaded).
"""
from __future__ import annotations

import heapq
import random
import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from policy.config import RoutingConfig
from policy.routing import choose_worker
from policy.types import RouteRequest, WorkerLoad

BLOCK = 16


@dataclass
class SimConfig:
    workers: int = 4
    slots: int = 4
    kv_blocks: int = 1024  # per worker
    prefill_tok_s: float = 2000.0
    decode_s: float = 1.5  # slot time of one answer
    sessions: int = 32
    turns: int = 8
    system_blocks: int = 64
    turn_blocks: tuple[int, int] = (8, 24)
    answer_blocks: int = 4
    think_s: tuple[float, float] = (0.5, 3.0)
    edit_prob: float = 0.1
    seed: int = 1


@dataclass
class Worker:
    wid: str
    cfg: SimConfig
    running: int = 0
    queue: deque = field(default_factory=deque)
    cache: OrderedDict = field(default_factory=OrderedDict)
    busy_area: float = 0.0  # integral of active requests over time
    last_t: float = 0.0

    def hit_blocks(self, blocks: list) -> int:
        n = 0
        for b in blocks:
            if b not in self.cache:
                break
            n += 1
        return n

    def touch(self, blocks: list) -> None:
        for b in blocks:
            self.cache[b] = True
            self.cache.move_to_end(b)
        while len(self.cache) > self.cfg.kv_blocks:
            self.cache.popitem(last=False)

    def account(self, now: float) -> None:
        self.busy_area += (self.running + len(self.queue)) * (now - self.last_t)
        self.last_t = now

    def load(self) -> WorkerLoad:
        return WorkerLoad(self.wid, running=self.running, waiting=len(self.queue), slots=self.cfg.slots,
                          kv_blocks_total=self.cfg.kv_blocks, kv_blocks_used=len(self.cache), block_size=BLOCK)


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    cached: int = 0
    oracle: int = 0
    load_ratio: float = 0.0  # max worker's time-averaged load over the mean

    @property
    def ttft_p50(self) -> float:
        return statistics.median(self.ttft)

    @property
    def hit_vs_oracle(self) -> float:
        return self.cached / self.oracle if self.oracle else 1.0


def simulate(strategy: str, sim: SimConfig = SimConfig(), routing: RoutingConfig | None = None) -> Result:
    rng = random.Random(sim.seed)
    cfg = (routing or RoutingConfig()).model_copy(update={"strategy": strategy})
    workers = [Worker(f"w{i}", sim) for i in range(sim.workers)]
    by_id = {w.wid: w for w in workers}
    contexts = {s: [("sys", i) for i in range(sim.system_blocks)] for s in range(sim.sessions)}
    turns_left = dict.fromkeys(range(sim.sessions), sim.turns)
    events: list = []  # (time, seq, kind, payload)
    seq = 0

    def push(t, kind, payload):
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, payload))

    for s in range(sim.sessions):
        push(rng.uniform(0, 5), "arrive", s)
    res, n, requests = Result(), 0, 0

    def start(w: Worker, now: float, job):
        s, blocks = job["session"], job["blocks"]
        hit = w.hit_blocks(blocks)
        res.cached += hit
        prefill = (len(blocks) - hit) * BLOCK / sim.prefill_tok_s
        w.touch(blocks)
        w.running += 1
        res.ttft.append(now - job["t"] + prefill)
        push(now + prefill + sim.decode_s, "done", (w.wid, s))

    while events:
        now, _, kind, payload = heapq.heappop(events)
        for w in workers:
            w.account(now)
        if kind == "arrive":
            s = payload
            ctx = contexts[s]
            if len(ctx) > sim.system_blocks + 4 and rng.random() < sim.edit_prob:
                cut = rng.randrange(sim.system_blocks, len(ctx))
                ctx[cut:] = [(s, n + i) for i in range(len(ctx) - cut)]  # edited: new blocks from the cut on
                n += len(ctx)
            ctx += [(s, n + i) for i in range(rng.randint(*sim.turn_blocks))]
            n += sim.turn_blocks[1]
            blocks = list(ctx)
            hits = {w.wid: h for w in workers if (h := w.hit_blocks(blocks))}
            res.oracle += max(hits.values(), default=0)
            requests += 1
            req = RouteRequest(len(blocks) * BLOCK, 64, session_id=f"s{s}", seq=requests)
            w = by_id[choose_worker([w.load() for w in workers], hits, req, cfg).worker_id]
            job = {"session": s, "blocks": blocks, "t": now}
            if w.running < sim.slots:
                start(w, now, job)
            else:
                w.queue.append(job)
        else:
            wid, s = payload
            w = by_id[wid]
            w.running -= 1
            contexts[s] += [(s, n + i) for i in range(sim.answer_blocks)]  # the answer joins the context
            n += sim.answer_blocks
            w.touch(contexts[s][-sim.answer_blocks:])
            if w.queue:
                start(w, now, w.queue.popleft())
            turns_left[s] -= 1
            if turns_left[s] > 0:
                push(now + rng.uniform(*sim.think_s), "arrive", s)
    areas = [w.busy_area for w in workers]
    res.load_ratio = max(areas) / (sum(areas) / len(areas))
    return res
