"""Shared set-up of the llama-server integration tests: the real binary, the real bundled model."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

from policy.config import PulseConfig
from policy.profiles import builtin_profiles
from tests.required import absent
from workers.llama_server.backend import LlamaServerBackend
from workers.llama_server.binary import find_llama_server
from workers.protocol import Chunk, GenerateRequest, SamplingParams
from workers.protocol.model import load_model_info, load_tokenizer

REQUIRE_ENV = "PULSE_REQUIRE_LLAMA_SERVER"


def llama_server_binary() -> Path:
    """The binary; a skip when it is not built, a failure under CI or with PULSE_REQUIRE_LLAMA_SERVER set
    (deploy/install.sh builds it, so a missing binary there is a broken install, not a reason to skip)."""
    try:
        return find_llama_server(os.environ.get("PULSE_LLAMA_SERVER") or None)
    except FileNotFoundError as e:
        absent(f"llama-server not built (run deploy/build_llama_server.sh): {e}", env=REQUIRE_ENV)


def make_config(tmp: Path, **overrides) -> PulseConfig:
    ls = {"binary": str(llama_server_binary()), "slots": 2, "kv_tokens": 4096, "threads": 1,
          "log_dir": str(tmp), "headers_timeout_s": 20.0, "stop_grace_s": 3.0}
    ls.update(overrides)
    return PulseConfig.model_validate({"workers": {"backend": "llama-server", "llama_server": ls}})


def serve_config(tmp: Path, *, slots: int, kv_tokens: int, threads: int, count: int | None = None,
                 timeouts: bool = True, more: str = "") -> str:
    """`pulse serve`'s config for the bundled Gemma on llama-server workers (count: the default where None),
    logs in `tmp`; `timeouts`: the short header and stop waits a test of a dying process wants; `more`: further
    top-level YAML."""
    waits = ", headers_timeout_s: 20, stop_grace_s: 3" if timeouts else ""
    count_line = "" if count is None else f"\n  count: {count}"
    return f"""
model: {{name: gemma-3-270m}}  # one model (a config naming none serves both bundled ones)
workers:
  backend: llama-server{count_line}
  llama_server: {{binary: "{llama_server_binary()}", slots: {slots}, kv_tokens: {kv_tokens}, threads: {threads},
                  log_dir: "{tmp}"{waits}}}
{more}"""


def make_backend(tmp: Path, sink=None, **overrides) -> LlamaServerBackend:
    config = make_config(tmp, **overrides)
    return LlamaServerBackend(config, builtin_profiles()["cpu"], load_model_info(), block_sink=sink, worker_id="t")


def encode(text: str) -> list[int]:
    """Gemma's chat-free prompt: BOS + the text's ids (the gateway does this before a worker sees it)."""
    info = load_model_info()
    ids = load_tokenizer().encode(text, add_special_tokens=False).ids
    return ([info.bos_token_id] if info.add_bos and info.bos_token_id is not None else []) + ids


def request(rid: str, prompt: list[int], max_tokens: int = 16, **kw) -> GenerateRequest:
    sampling = kw.pop("sampling", SamplingParams(temperature=0.0))
    return GenerateRequest(request_id=rid, prompt_ids=prompt, max_tokens=max_tokens, sampling=sampling, **kw)


async def collect(backend, req: GenerateRequest) -> list[Chunk]:
    return [c async for c in backend.generate(req)]


def direct_answer(backend, body: dict, timeout: float = 60) -> dict:
    """llama-server's own non-streaming /completion answer to `body`, bypassing Pulse (prompt not cached unless
    `body` says so)."""
    import json
    import urllib.request

    data = json.dumps({"cache_prompt": False, "return_tokens": True, "stream": False, **body}).encode()
    req = urllib.request.Request(backend.lanes[0].process.url + "/completion", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def check_interleaved_restore(backend) -> None:
    """deploy/llama_patches/0003's round on a started `backend` of 2 slots serving SmolLM2 with llama-server's RAM
    prompt cache on: a note generated on slot 0 beside another on slot 1 (one cell each per step of the unified KV, so
    the note's state is dozens of one-cell ranges a layer), displaced to the RAM cache by a third prompt, then
    continued on slot 0. llama-server must take all of it back from the cache (a few of its ~100 tokens evaluated
    again) and go on with the tokens the note gives alone, asked last and uncached so that the cache held no other
    copy of the note to load. SmolLM2, not Gemma: with Gemma's sliding-window layers llama-server rolls a restored
    sequence back to its last context checkpoint (the prompt's end) and evaluates the generated part again, so the
    interleaved cells would never be read back (checked: a build copying them from the wrong place of the span
    passed with Gemma and failed with SmolLM2). Counting: a greedy continuation with a wide margin at every token, so
    batching's rounding does not flip it."""
    tok = load_tokenizer(str(backend.model.path))

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    def post(body: dict) -> dict:
        return direct_answer(backend, {"cache_prompt": True, "temperature": 0.0, **body}, timeout=60)

    a, b = (encode(f"Note {i}: counting up, " + ", ".join(str(n) for n in range(100 * i + 11, 100 * i + 23)) + ",")
            for i in (1, 2))
    first, _ = await asyncio.gather(asyncio.to_thread(post, {"prompt": a, "n_predict": 32, "id_slot": 0}),
                                    asyncio.to_thread(post, {"prompt": b, "n_predict": 40, "id_slot": 1}))
    post({"prompt": encode("The three primary colours are red, yellow and blue."), "n_predict": 4, "id_slot": 0})
    again = post({"prompt": a + first["tokens"], "n_predict": 16, "id_slot": 0})
    assert again["timings"]["prompt_n"] < 8, again["timings"]  # the whole note came back from the cache
    ref = post({"prompt": a, "n_predict": 48, "id_slot": 1, "cache_prompt": False})["tokens"]
    assert first["tokens"] == ref[:32]
    assert again["tokens"] == ref[32:48], (again["tokens"], ref[32:48])
