"""CPU the request-migration relay adds per streamed chunk (gateway/migration.py).

To move a stream, the Relay keeps the token ids it has handed to the client (`delivered`). This measures,
in one run, interleaved:
- "plain relay": yield each batch of the worker stream and stop at the final chunk (what the gateway did
  before migration);
- "Relay": gateway/migration.py's Relay.batches() over the same batches (the final-chunk check plus the
  tracking);
- "Relay, scanning every chunk": the same with the final-chunk check looking at every chunk of a batch
  (gateway.migration's `_scan_to_end`, the form before the last-chunk fast path), swapped in for that case only;
- "tracking only": the tracking statement alone, into an array('i') as the Relay does
  (`delivered.fromlist(chunk.token_ids)`: 4 bytes a token), into a list (`delivered += chunk.token_ids`:
  a slot plus the id's int object kept alive, ~36 bytes a token), and into an array by `extend`; "loop
  only" is the same loops without the statement.

The worker stream is a prepared list of batches served by an async generator, and the dispatcher, ticket
and metrics are stand-ins the relay never calls unless a worker fails (none does here): the figures are
the relay's own CPU, not a worker's or the network's. Process CPU time per chunk; median and min-max over
repeats.

    python -m bench.migration_cost [--repeats 7] [--chunks 20000] [--per-batch 1] [--tokens-per-chunk 1]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from types import SimpleNamespace

from workers.protocol import Chunk, Usage


def worker_stream(chunks: int, per_batch: int, tokens: int) -> list[list[Chunk]]:
    """`chunks` chunks of `tokens` ids each in batches of `per_batch`; the last chunk is final."""
    out = [Chunk(text=" tok", token_ids=[1000 + i % 50_000 + j for j in range(tokens)]) for i in range(chunks - 1)]
    out.append(Chunk(text=".", token_ids=[7] * tokens, finish_reason="length", usage=Usage(completion_tokens=chunks)))
    return [out[i:i + per_batch] for i in range(0, len(out), per_batch)]


async def _rest(batches: list[list[Chunk]]):
    for b in batches[1:]:
        yield b


async def plain(batches: list[list[Chunk]]) -> int:
    """Relay without migration: the first batch, then the stream until a final chunk."""
    n = 0

    async def relay():
        yield batches[0]
        async for b in _rest(batches):
            yield b
            if b[-1].finish_reason is not None:
                return

    async for b in relay():
        n += len(b)
    return n


async def relay(batches: list[list[Chunk]], tokens: int, until_end=None) -> int:
    from gateway import migration
    from gateway.migration import Relay

    if until_end is not None:
        kept, migration._until_end = migration._until_end, until_end

    worker = SimpleNamespace(worker_id="w0")
    ticket = SimpleNamespace(worker=worker, first=batches[0], chunks=_rest(batches))
    r = Relay(SimpleNamespace(), SimpleNamespace(request_id="r", max_tokens=1 << 30), ticket, SimpleNamespace())
    n = 0
    try:
        async for b in r.batches():
            n += len(b)
    finally:
        if until_end is not None:
            migration._until_end = kept
    assert len(r.delivered) == tokens  # it tracked every id
    return n


def tracking(batches: list[list[Chunk]]) -> int:
    """The Relay's statement."""
    n, sink = 0, array("i")
    for b in batches:
        for c in b:
            sink.fromlist(c.token_ids)
            n += 1
    return n


def tracking_list(batches: list[list[Chunk]]) -> int:
    n, sink = 0, []
    for b in batches:
        for c in b:
            sink += c.token_ids
            n += 1
    return n


def tracking_extend(batches: list[list[Chunk]]) -> int:
    n, sink = 0, array("i")
    for b in batches:
        for c in b:
            sink.extend(c.token_ids)
            n += 1
    return n


def empty_loop(batches: list[list[Chunk]]) -> int:
    """The same two loops without the statement: subtracted from the tracking figures."""
    n = 0
    for b in batches:
        for c in b:
            n += 1
    return n


def cases(batches) -> dict[str, Callable[[], int]]:
    from gateway import migration

    tokens = sum(len(c.token_ids) for b in batches for c in b)
    return {"plain relay": lambda: asyncio.run(plain(batches)),
            "Relay (migration.py)": lambda: asyncio.run(relay(batches, tokens)),
            "Relay, scanning every chunk": lambda: asyncio.run(relay(batches, tokens, migration._scan_to_end)),
            "loop only": lambda: empty_loop(batches),
            "tracking, array fromlist": lambda: tracking(batches),
            "tracking, list +=": lambda: tracking_list(batches),
            "tracking, array extend": lambda: tracking_extend(batches)}


def ns_per_chunk(fn: Callable[[], int]) -> float:
    start = time.process_time()
    n = fn()
    return (time.process_time() - start) / n * 1e9


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.migration_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--chunks", type=int, default=20_000, help="chunks per timing (one stream)")
    ap.add_argument("--per-batch", type=int, default=1, help="chunks per read of the worker stream")
    ap.add_argument("--tokens-per-chunk", type=int, default=1)
    args = ap.parse_args(argv)
    batches = worker_stream(args.chunks, args.per_batch, args.tokens_per_chunk)
    runs = cases(batches)
    for fn in runs.values():
        fn()  # warm: imports, first event loop
    got: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            got[name].append(ns_per_chunk(fn))
    print(f"{args.chunks} chunks of {args.tokens_per_chunk} token(s), {args.per_batch} chunk(s) per batch, "
          f"{args.repeats} repeats")
    for name, values in got.items():
        print(f"{name:26s} {statistics.median(values):7.0f} ns CPU per chunk ({min(values):.0f}-{max(values):.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
