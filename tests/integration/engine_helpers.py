"""Shared by the engine's real-model tests: the bundled model's engine, built small, and a driver."""
from __future__ import annotations

from collections import defaultdict
from functools import lru_cache

import numpy as np

from workers.cupy.engine import Engine, create_engine
from workers.cupy.models import build_model
from workers.cupy.ops import Ops
from workers.cupy.weights import load_weights
from workers.protocol import GenerateRequest, SamplingParams
from workers.protocol.model import load_model_info, load_tokenizer

GREEDY = SamplingParams(temperature=0.0)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
    "Photosynthesis is the process by which plants",
    "<start_of_turn>user\nName three primary colors.<end_of_turn>\n<start_of_turn>model\n",
]


@lru_cache(maxsize=1)
def shared_model():
    info = load_model_info(None)
    return info, build_model(info, load_weights(info.path), Ops(np))


def encode(text: str) -> list[int]:
    info = load_model_info(None)
    return [info.bos_token_id] + load_tokenizer(None).encode(text, add_special_tokens=False).ids


def make_engine(num_blocks=256, block_size=16, max_num_seqs=8, max_step_tokens=512, block_sink=None,
                **kw) -> Engine:
    """An engine over the one shared model (weights built once per test process); `kw`: create_engine's."""
    info, model = shared_model()
    return create_engine(info, None, np, block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                         max_step_tokens=max_step_tokens, context_length=info.context_length,
                         block_sink=block_sink, model=model, seed=0, **kw)


def run(engine: Engine, prompts: list[list[int]], max_tokens: int, sampling=GREEDY, tag="r", **kw):
    """Submit every prompt at once and step until all finish: (tokens per prompt, final outputs)."""
    for i, ids in enumerate(prompts):
        engine.add(GenerateRequest(request_id=f"{tag}{i}", prompt_ids=ids, max_tokens=max_tokens,
                                   sampling=sampling, **({"ignore_eos": True} | kw)))
    tokens, final = defaultdict(list), {}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.finish_reason:
                final[out.request_id] = out
    return [tokens[f"{tag}{i}"] for i in range(len(prompts))], [final[f"{tag}{i}"] for i in range(len(prompts))]


def prompt_logits(ids: list[int]) -> np.ndarray:
    """The engine's next-token logits after the whole prompt, from one prefill step on a fresh engine."""
    from workers.cupy.batch import build_batch

    engine = make_engine(max_step_tokens=len(ids))
    engine.add(GenerateRequest(request_id="logits", prompt_ids=ids, max_tokens=1))
    scheduled = engine.scheduler.schedule()
    assert [n for _, n in scheduled] == [len(ids)], "the prompt must fit one step"
    logits = engine.model.forward(build_batch(scheduled, engine.blocks.block_size, np), engine.kv)
    engine.abort("logits")
    return np.asarray(logits[0])
