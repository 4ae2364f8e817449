"""One request's state inside the engine: its tokens, how many have KV in the cache, its blocks."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from workers.cupy.rng import seed_key
from workers.protocol import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)  # slots: the engine reads a sequence's fields several times a step
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt, then generated tokens; a preempted sequence recomputes all of them
    max_tokens: int  # generated tokens allowed (already capped by the context length)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: int | None = None
    num_prompt_tokens: int = 0
    num_computed: int = 0  # tokens whose K/V is in the cache
    num_cached: int = -1  # prompt tokens served from the prefix cache at first admission; -1: not yet
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of the leading full blocks
    # sliding-window layers' blocks (kv_cache.py, two pools): same index as block_table, -1 once slid out;
    # empty with one pool. local_start: entries before it are all -1.
    local_table: list[int] = field(default_factory=list)
    local_start: int = 0
    table_row: int = -1  # its row in its BlockManager's BlockTables while it holds blocks, else -1
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    arrival: int = 0  # admission order; preemption takes the newest first
    queued_step: int = 0  # the scheduler's step count when it joined the waiting queue (prefill coalescing)
    num_drafted: int = 0  # speculation: draft tokens proposed for this sequence (verified or not)
    num_accepted: int = 0  # speculation: draft tokens that verification kept
    seed: int = 0  # the sampler's key: the request's seed, or one the engine drew for it (sampler.py)
    _seed_key: tuple[int, int] = (-1, 0)  # (seed, rng.seed_key(seed)): computed once, not per token
    # (seed key, prompt length, 1/T's float32 bits or 0, logprobs asked, sampler.row_asks' bits):
    # engine.row_constants, once a life
    row_constants: tuple[int, int, int, int, int] | None = None

    def seed_key(self) -> int:
        if self._seed_key[0] != self.seed:
            self._seed_key = (self.seed, seed_key(self.seed))
        return self._seed_key[1]

    def __post_init__(self):
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_remaining(self) -> int:
        """Known tokens whose K/V still has to be computed (prefill left, or the last sampled token)."""
        return len(self.token_ids) - self.num_computed
