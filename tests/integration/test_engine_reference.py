"""The engine's fp32 NumPy path against a second implementation of the same GGUF file: transformers'
GGUF loader (its own Gemma 3 code, PyTorch on the CPU).

Not independent in one respect: transformers dequantizes through the same gguf-py functions as the engine,
so a dequantization bug would pass here. llama.cpp's own greedy tokens on the same GGUF are the independent
reference for that (tests/integration/test_engine_llamacpp_parity.py).

Greedy continuations must be identical for 32 tokens on 5 prompts, and last-position logits must have
cosine >= 0.999, including a prompt longer than the 512-token sliding window.
"""
import numpy as np
import pytest

from tests.integration.engine_helpers import PROMPTS, encode, make_engine, prompt_logits, run
from tests.required import absent

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

try:
    import torch
except ImportError:  # the test extra installs it: under CI a missing reference is a broken install
    absent("the reference needs torch (pip install -e '.[test]')")
N_TOKENS = 32


@pytest.fixture(scope="module")
def reference():
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from workers.protocol.model import load_model_info

    torch.set_num_threads(2)
    path = Path(load_model_info(None).path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def reference_greedy(model, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """n greedy tokens (EOS not special) with the KV cache, and the logits after the prompt."""
    out, past, first_logits = [], None, None
    step_ids = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = model(input_ids=step_ids, past_key_values=past, use_cache=True)
            logits = res.logits[0, -1]
            if first_logits is None:
                first_logits = logits.numpy().copy()
            past, token = res.past_key_values, int(logits.argmax())
            out.append(token)
            step_ids = torch.tensor([[token]])
    return out, first_logits


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_greedy_continuations_and_logits_match_transformers(reference):
    prompts = [encode(p) for p in PROMPTS]
    engine = make_engine()
    tokens, _ = run(engine, prompts, N_TOKENS)  # all five batched together
    for ids, got in zip(prompts, tokens):
        want, want_logits = reference_greedy(reference, ids, N_TOKENS)
        assert got == want
        assert cosine(prompt_logits(ids), want_logits) >= 0.999


def test_a_prompt_past_the_sliding_window_matches_transformers(reference):
    ids = encode(" ".join(PROMPTS * 12))[:700]
    want, want_logits = reference_greedy(reference, ids, 8)
    assert cosine(prompt_logits(ids), want_logits) >= 0.999
    chunked, _ = run(make_engine(max_step_tokens=128), [ids], 8)
    assert chunked[0] == want
