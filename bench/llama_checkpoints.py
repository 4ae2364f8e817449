"""Time to first token for a long prompt returning to a managed llama-server: cold, still in its slot, from
llama-server's RAM prompt cache, and restored from a Pulse slot checkpoint (issue 5, "Checkpoints").

Two LlamaServerBackends with one slot each (so a second prompt always takes the slot), the bundled model:
- `ram`: checkpoints off, llama-server's RAM prompt cache on (`--cache-ram`, its default);
- `ckpt`: checkpoints on, the RAM prompt cache off (`--cache-ram 0`), so only the file can bring it back.
Configurations, each a fresh salted prompt of ~`--tokens` tokens, the timed request = that prompt + a short
new turn (the agent case: a session returning with one more message):
- `cold`: never seen: full prefill (on `ram`);
- `slot`: sent once untimed, then timed: the slot still holds it (on `ram`);
- `ram_cache`: sent, then a different ~300-token prompt takes the slot, then timed (on `ram`);
- `checkpoint`: the same on `ckpt`: Pulse saved the slot to a file before the other prompt took it and
  restores it before the timed request.
Measured through `LlamaServerBackend.generate` (send to the first streamed token); `cached` is llama-server's
`timings.cache_n`. Protocol: warm-up discarded, configurations interleaved and rotated, >= 5 repeats.

    python -m bench.llama_checkpoints --tokens 1500 --repeats 5 --warmup 2
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from bench import protocol
from bench.machine import machine_info
from policy.config import PulseConfig
from policy.profiles import builtin_profiles
from workers.llama_server.backend import LlamaServerBackend
from workers.protocol import GenerateRequest, SamplingParams
from workers.protocol.model import load_model_info, load_tokenizer

RESULTS = Path("bench/results")
METRICS = ["ttft_ms", "cached_tokens", "prompt_tokens"]
TEXT = ("An agent's working notes: the build failed on the linker step, so check the library path, rerun the "
        "configure script with verbose output, compare the flags with the last good run, and record each change. ")
OTHER = "A different session entirely: a recipe for bread with flour, water, salt and yeast, kneaded and proved. "


class Prompts:
    def __init__(self, tokens: int):
        info, self.tok = load_model_info(), load_tokenizer()
        self.bos = [info.bos_token_id] if info.add_bos and info.bos_token_id is not None else []
        body = self.tok.encode(TEXT, add_special_tokens=False).ids
        self.body = (body * (tokens // len(body) + 1))[:tokens]
        self.turn = self.tok.encode(" Next message: what should I try first?", add_special_tokens=False).ids
        other = self.tok.encode(OTHER, add_special_tokens=False).ids
        self.other = (other * (300 // len(other) + 1))[:300]

    def fresh(self) -> list[int]:
        """A prompt no cache has seen: a unique salt at its head."""
        return self.bos + self.tok.encode(f"Session {uuid.uuid4().hex}: ", add_special_tokens=False).ids + self.body

    def evicting(self) -> list[int]:
        return self.bos + self.tok.encode(f"Other {uuid.uuid4().hex}: ", add_special_tokens=False).ids + self.other


def backend(checkpoints: bool, threads: int, tmp: Path, name: str) -> LlamaServerBackend:
    ls = {"slots": 1, "kv_tokens": 8192, "threads": threads, "log_dir": str(tmp), "headers_timeout_s": 120.0}
    if checkpoints:
        ls |= {"extra_args": ["--cache-ram", "0"],
               "checkpoints": {"enabled": True, "dir": str(tmp / "ckpt"), "min_tokens": 512}}
    cfg = PulseConfig.model_validate({"workers": {"backend": "llama-server", "llama_server": ls}})
    return LlamaServerBackend(cfg, builtin_profiles()["cpu"], load_model_info(), worker_id=name)


async def timed(b: LlamaServerBackend, prompt: list[int], max_tokens: int = 2) -> dict:
    req = GenerateRequest(request_id=uuid.uuid4().hex, prompt_ids=prompt, max_tokens=max_tokens,
                          sampling=SamplingParams(temperature=0.0))
    t0 = time.perf_counter()
    ttft, usage = None, None
    async for chunk in b.generate(req):
        if ttft is None:
            ttft = (time.perf_counter() - t0) * 1000
        usage = chunk.usage or usage
    return {"ttft_ms": ttft, "cached_tokens": usage.cached_tokens, "prompt_tokens": usage.prompt_tokens}


def measures(ram: LlamaServerBackend, ckpt: LlamaServerBackend, p: Prompts) -> dict:
    async def cold():
        return await timed(ram, p.fresh() + p.turn)

    async def slot():
        prompt = p.fresh()
        await timed(ram, prompt)
        return await timed(ram, prompt + p.turn)

    def returning(b: LlamaServerBackend):
        async def measure():
            prompt = p.fresh()
            await timed(b, prompt)
            await timed(b, p.evicting())  # takes the one slot
            return await timed(b, prompt + p.turn)
        return measure

    return {"cold": cold, "slot": slot, "ram_cache": returning(ram), "checkpoint": returning(ckpt)}


async def run(args) -> tuple[list[dict], dict]:
    tmp = Path(tempfile.mkdtemp(prefix="pulse-ckpt-bench-"))
    ram, ckpt = backend(False, args.threads, tmp, "ram"), backend(True, args.threads, tmp, "ckpt")
    await ram.start()
    await ckpt.start()
    try:
        records = await protocol.run(measures(ram, ckpt, Prompts(args.tokens)), args.repeats, args.warmup,
                                     not args.quiet)
        c = ckpt.checkpoints
        files = sorted((tmp / "ckpt" / "ckpt").glob("*.slot"))
        extra = {"saves": c.saves, "restores": c.restores, "failures": c.failures,
                 "save_ms_median": statistics.median(c.save_ms) if c.save_ms else None,
                 "restore_ms_median": statistics.median(c.restore_ms) if c.restore_ms else None,
                 "restore_ms_min_max": [min(c.restore_ms), max(c.restore_ms)] if c.restore_ms else None,
                 "file_bytes_median": statistics.median(f.stat().st_size for f in files) if files else None}
    finally:
        await ram.close()
        await ckpt.close()
    return records, extra


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1500, help="length of the returning prompt")
    ap.add_argument("--threads", type=int, default=1, help="llama-server -t for each of the two processes")
    protocol.add_arguments(ap, RESULTS)
    args = ap.parse_args(argv)
    machine = machine_info()
    started = time.time()
    records, extra = asyncio.run(run(args))
    summary = protocol.summarize(records)
    params = vars(args) | {"out": str(args.out), "checkpointer": extra}
    doc = protocol.result_document("llama_checkpoints", records, summary, params, started, machine)
    notes = "Checkpointer over the whole run (warm-up included): " + ", ".join(f"{k} {v}" for k, v in extra.items())
    paths = protocol.write_result(doc, protocol.markdown_table(summary, METRICS, digits=1), METRICS, args.out, notes)
    print(paths["md"].read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
