"""Pipeline parallelism (issue 10): the single-stage engine vs the same engine with its layers in N stage
actors, on one device, in process.

    python -m bench.pipeline --device cuda --model MODEL.gguf --stages 2 --batches 1 32 --tokens 64
    python -m bench.pipeline --device cpu --batches 1 4 --tokens 8 --repeats 5      # the CPU box

Configurations, interleaved per repeat (bench/protocol.py): `single-bB` (the engine as the worker runs it:
on a GPU, decode steps as CUDA graphs), `pipe-bB` (N stages, one micro-batch per stage, drained at every
step's end), `pipe1-bB` (N stages, no micro-batching: the stages take turns), `pipex-bB` (cross-step
pipelining, workers/pipeline/overlap.py: N groups of sequences, one step of each in the ring at once) and
`pipetcp-bB` (as `pipe`, arrays over the loopback sockets instead of shared memory; the others use shared
memory when the stages share the host); on a GPU also `pipe1ipc-bB` and `pipeipc-bB` (as `pipe1` and `pipe`,
the residual stream device to device through CUDA IPC, workers/pipeline/cuda_ipc.py, as serving does by
default on one host). The same stages serve every configuration, rewired onto each one's transport.
`--stage-gpus 0,1` starts a second set of stages, stage i on GPU i of the list, and runs the pipelined
configurations on it too, prefixed `gpus` (`gpuspipe1-bB`, `gpuspipeipc-bB`, ...), in the same run.
Each run submits B distinct prompts, greedy, and times decode only (from the step after every sequence has
its first token to the last token).
Metrics: aggregate decode tok/s, ms per decode step (decode time / tokens each sequence decoded: with
cross-step pipelining one engine call finishes one group, so calls are not steps), the pipeline's transfer
cost per token (send + receive at every hop, from PipelineStats) and bytes per token, and `identical` (1
when the run's tokens equal the single-stage engine's for the same batch), `ipc_share` (the share of the
run's hops that went through CUDA IPC: 1 for the `ipc` rows when no message fell back to host memory). The
notes give the batch-1 per-token overhead (pipe minus
single, ms per step) and the aggregate ratio at the largest batch (goal >= 0.8).

`--launcher process` starts the stages as plain processes instead of Ray actors (a box without Ray).
`--only single pipe1 pipe1ipc` runs only those configurations (each at every batch).

`--wire` measures the transport alone: a ping-pong between this process and an echo process over one
loopback hop, `tcp` (arrays on the socket) against `shm` (arrays through the shared-memory ring, header
on the socket), for messages of 1, 8, 32 and 512 tokens of this model's residual stream (640 fp32), without
the model: µs per hop (round trip / 2) and MB/s of payload.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import os
import time
from pathlib import Path

import numpy as np

from bench import protocol
from bench.machine import machine_info

TEXTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village by the sea,",
         "Photosynthesis is the process by which plants", "List three primary colors:"]


def build(args, info, weights):
    """{'single': engine, 'pipe': engine}; both with the same sizes."""
    from workers.pipeline.build import create_pipelined_engine, stage_plan

    kw = dict(block_size=16, num_blocks=2048, max_num_seqs=max(args.batches), max_step_tokens=4096,
              context_length=2048)
    if args.device == "cpu":
        from workers.cupy.engine import create_engine

        single = create_engine(info, weights, np, **kw)
    else:
        from workers.cupy.gpu import create_gpu_engine

        single = create_gpu_engine(info, weights, **kw)
    n_layers = info.hparams[f"{info.architecture}.block_count"]

    def pipelined():
        return create_pipelined_engine(
            info, weights, stages_plan=stage_plan(n_layers, [], args.stages, args.device), device=args.device,
            micro_batches=args.stages, model_path=str(info.path), launcher=args.launcher, cuda_ipc=False, **kw)[0]

    engines = {"single": single, "pipe": pipelined()}
    if args.stage_gpus:  # the same stages again, stage i on GPU i of the list (the plain-process launcher's
        os.environ["PULSE_STAGE_GPUS"] = args.stage_gpus  # placement; the driver stays on this process's GPU)
        try:
            engines["gpus"] = pipelined()
        finally:
            del os.environ["PULSE_STAGE_GPUS"]
    return engines


def prompts(info, tok, batch: int) -> list[list[int]]:
    return [[info.bos_token_id] + tok.encode(f"{TEXTS[i % len(TEXTS)]} ({i})").ids for i in range(batch)]


def run_once(engine, ids: list[list[int]], tokens: int, tag: str) -> tuple[dict, list[list[int]]]:
    from workers.protocol import GenerateRequest, SamplingParams

    for i, p in enumerate(ids):
        engine.add(GenerateRequest(request_id=f"{tag}-{i}", prompt_ids=p, max_tokens=tokens,
                                   sampling=SamplingParams(temperature=0.0), ignore_eos=True))
    out = {f"{tag}-{i}": [] for i in range(len(ids))}
    t0 = None
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.token_ids
        if t0 is None and all(out.values()):
            t0 = time.perf_counter()  # every sequence has its first token: decode starts
    elapsed = time.perf_counter() - t0
    decoded = sum(len(v) - 1 for v in out.values())
    steps = max(decoded / len(ids), 1)  # decode steps each sequence went through
    return {"tok_s": decoded / elapsed, "ms_per_step": 1e3 * elapsed / steps}, list(out.values())


def measures(args, engines, info, tok):
    reference: dict[int, list] = {}
    counter = iter(range(10**9))

    def make(name: str, batch: int, micro_batches: int, groups: int = 0, transport: str = "shm"):
        engine = engines["single" if name == "single" else "gpus" if name.startswith("gpus") else "pipe"]

        async def measure():
            if name != "single":
                engine.model.micro_batches, engine.groups = micro_batches, groups
                if engine.model.mode != transport:  # same stages, wired over the other transport (KV kept)
                    engine.model.rewire(engine.pipeline_actors, transport != "tcp", transport == "ipc")
                before = copy.deepcopy(engine.model.stats.as_dict())
            metrics, toks = run_once(engine, prompts(info, tok, batch), args.tokens, f"{name}{next(counter)}")
            if name == "single":
                reference[batch] = toks
            else:
                after = engine.model.stats.as_dict()
                n = max(after["tokens"] - before["tokens"], 1)
                metrics["transfer_us_per_token"] = 1e6 * (after["transfer_s"] - before["transfer_s"]) / n
                steps = max(len(toks[0]), 1)  # steps each sequence went through (prefill + decode): ms per step
                metrics["stages_ms"] = 1e3 * sum(a - b for a, b in zip(after["stage_compute_s"],
                                                                       before["stage_compute_s"])) / steps
                metrics["driver_ms"] = 1e3 * (after["embed_s"] + after["head_s"] - before["embed_s"]
                                              - before["head_s"]) / steps
                metrics["transfer_ms"] = 1e3 * (after["transfer_s"] - before["transfer_s"]) / steps
                metrics["bytes_per_token"] = (after["bytes"] - before["bytes"]) / n
                hops = (after["messages"] - before["messages"]) * (after["stages"] + 1)
                metrics["ipc_share"] = (after["ipc_hops"] - before["ipc_hops"]) / max(hops, 1)
                if batch in reference:
                    metrics["identical"] = float(toks == reference[batch])
            return metrics

        return measure

    out = {}
    for b in args.batches:
        out[f"single-b{b}"] = make("single", b, 1)
        out[f"pipe-b{b}"] = make("pipe", b, args.stages)
        out[f"pipe1-b{b}"] = make("pipe1", b, 1)
        out[f"pipex-b{b}"] = make("pipex", b, args.stages, args.stages)
        out[f"pipetcp-b{b}"] = make("pipetcp", b, args.stages, transport="tcp")
        if args.device == "cuda" and engines["pipe"].model.ipc_hops[0]:  # CUDA IPC planned for this placement
            out[f"pipe1ipc-b{b}"] = make("pipe1ipc", b, 1, transport="ipc")
            out[f"pipeipc-b{b}"] = make("pipeipc", b, args.stages, transport="ipc")
        if "gpus" in engines:  # the stages on --stage-gpus: the same configurations, prefixed `gpus`
            out[f"gpuspipe1-b{b}"] = make("gpuspipe1", b, 1)
            out[f"gpuspipe-b{b}"] = make("gpuspipe", b, args.stages)
            if engines["gpus"].model.ipc_hops[0]:
                out[f"gpuspipe1ipc-b{b}"] = make("gpuspipe1ipc", b, 1, transport="ipc")
                out[f"gpuspipeipc-b{b}"] = make("gpuspipeipc", b, args.stages, transport="ipc")
    if args.only:  # a subset of the configurations, by name without the batch
        out = {k: v for k, v in out.items() if k.rsplit("-b", 1)[0] in args.only}
    return out


def notes(summary: dict, batches: list[int]) -> str:
    lines = []
    b1, bn = min(batches), max(batches)
    s, p = summary.get(f"single-b{b1}"), summary.get(f"pipe-b{b1}")
    if s and p:
        lines.append(f"Per-token overhead at batch {b1}: {p['ms_per_step']['median'] - s['ms_per_step']['median']:.3f} "
                     f"ms per step (pipe {p['ms_per_step']['median']:.3f} vs single {s['ms_per_step']['median']:.3f}).")
    s = summary.get(f"single-b{bn}")
    for name in ("pipe", "pipe1", "pipeipc", "pipe1ipc", "gpuspipe", "gpuspipe1", "gpuspipeipc", "gpuspipe1ipc"):
        p = summary.get(f"{name}-b{bn}")
        if s and p:
            ratio = p["tok_s"]["median"] / s["tok_s"]["median"]
            lines.append(f"Aggregate at batch {bn}: {name} / single = {ratio:.2f} "
                         f"(goal >= 0.8: {'met' if ratio >= 0.8 else 'missed'}).")
    for name in ("pipe1", "pipe1ipc", "gpuspipe1", "gpuspipe1ipc"):
        s, p = summary.get(f"single-b{b1}"), summary.get(f"{name}-b{b1}")
        if s and p:
            lines.append(f"Per-token overhead at batch {b1}, {name}: "
                         f"{p['ms_per_step']['median'] - s['ms_per_step']['median']:.3f} ms per step.")
    return "\n".join(lines)


WIRE_TOKENS = (1, 8, 32, 512)
WIRE_HIDDEN = 640


def _echo(port: int, shm: bool) -> None:
    """The far end of the --wire ping-pong: every message straight back, over the same transport."""
    from workers.pipeline import wire
    from workers.pipeline.shm import ShmReader, ShmRing

    sock, reader, ring = wire.connect("127.0.0.1", port), ShmReader(), ShmRing() if shm else None
    try:
        while (msg := wire.recv(sock, reader))[0].get("kind") != "stop":
            wire.send(sock, msg[0], msg[1], ring)
            reader.release()
    finally:
        reader.close()
        if ring is not None:
            ring.close()


def wire_measures(stack):
    import multiprocessing as mp

    from workers.pipeline import wire
    from workers.pipeline.shm import ShmReader, ShmRing

    ends = {}
    for name in ("tcp", "shm"):
        lis = wire.listener("127.0.0.1")
        proc = mp.get_context("spawn").Process(target=_echo, args=(lis.getsockname()[1], name == "shm"), daemon=True)
        proc.start()
        sock, _ = lis.accept()
        lis.close()
        ends[name] = (wire.tune(sock), ShmReader(), ShmRing() if name == "shm" else None, proc)
    stack.append(ends)

    def make(name: str, tokens: int):
        sock, reader, ring, _ = ends[name]
        x = np.random.default_rng(0).standard_normal((tokens, WIRE_HIDDEN), dtype=np.float32)
        n = max(20, 4000 // tokens)

        async def measure():
            t0 = time.perf_counter()
            for _ in range(n):
                wire.send(sock, {"kind": "run"}, {"x": x}, ring)
                wire.recv(sock, reader)
                reader.release()
            hop = (time.perf_counter() - t0) / n / 2
            return {"us_per_hop": 1e6 * hop, "MB_s": x.nbytes / hop / 1e6}

        return measure

    return {f"{name}-t{t}": make(name, t) for t in WIRE_TOKENS for name in ("tcp", "shm")}


def close_wire(ends: dict) -> None:
    from workers.pipeline import wire

    for sock, reader, ring, proc in ends.values():
        wire.send(sock, {"kind": "stop"}, {})
        proc.join(timeout=10)
        sock.close()
        reader.close()
        if ring is not None:
            ring.close()


def main_wire(args) -> int:
    machine = machine_info()
    started, stack = time.time(), []
    try:
        records = asyncio.run(protocol.run(wire_measures(stack), args.repeats, args.warmup, not args.quiet))
    finally:
        for ends in stack:
            close_wire(ends)
    summary = protocol.summarize(records)
    metrics = ["us_per_hop", "MB_s"]
    table = protocol.markdown_table(summary, metrics)
    doc = protocol.result_document("pipeline-wire", records, summary, vars(args) | {"out": str(args.out)}, started,
                                   machine)
    paths = protocol.write_result(doc, table, metrics, args.out, "")
    print(table)
    print(f"wrote {paths['md']}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default=None, help="GGUF file (default: the bundled model)")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--launcher", default="ray", choices=["ray", "process"])
    ap.add_argument("--threads", type=int, default=1, help="BLAS threads on the CPU path")
    ap.add_argument("--wire", action="store_true", help="measure the transport alone (tcp vs shm ping-pong)")
    ap.add_argument("--stage-gpus", default="",
                    help="also run every pipelined configuration with stage i on GPU i of this list (e.g. 0,1; "
                         "--launcher process): rows prefixed `gpus`")
    ap.add_argument("--only", nargs="+", default=None,
                    help="run only these configurations (e.g. single pipe1 pipe1ipc pipe pipeipc); default: all")
    protocol.add_arguments(ap, Path("bench/results"))
    args = ap.parse_args(argv)
    if args.wire:
        return main_wire(args)
    from threadpoolctl import threadpool_limits

    from workers.cupy.weights import load_weights
    from workers.pipeline.build import close_pipeline
    from workers.protocol.model import load_model_info, load_tokenizer

    threadpool_limits(args.threads)
    if args.launcher == "ray":
        import ray

        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    machine = machine_info()
    info = load_model_info(args.model)
    engines = build(args, info, load_weights(info.path))
    started = time.time()
    try:
        records = asyncio.run(protocol.run(measures(args, engines, info, load_tokenizer(args.model)),
                                           args.repeats, args.warmup, not args.quiet))
    finally:
        for name in ("pipe", "gpus"):
            if name in engines:
                close_pipeline(engines[name])
    summary = protocol.summarize(records)
    metrics = ["tok_s", "ms_per_step", "stages_ms", "driver_ms", "transfer_ms", "transfer_us_per_token",
               "bytes_per_token", "ipc_share", "identical"]
    table = protocol.markdown_table(summary, metrics)
    doc = protocol.result_document("pipeline", records, summary, vars(args) | {"out": str(args.out)}, started, machine)
    note = notes(summary, args.batches)
    paths = protocol.write_result(doc, table, metrics, args.out, note)
    print(table)
    print(note)
    print(f"wrote {paths['md']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
