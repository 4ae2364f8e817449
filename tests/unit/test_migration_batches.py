"""The relay's cut of a worker batch at its end (gateway/migration.py), and the bench of its per-chunk cost."""
from __future__ import annotations

import pytest

from bench import migration_cost
from gateway.migration import _scan_to_end, _until_end
from workers.protocol import Chunk, Usage

TOK = Chunk(text="a", token_ids=[1])
END = Chunk(text=".", token_ids=[2], finish_reason="length", usage=Usage(completion_tokens=3))
ERR = Chunk(finish_reason="error", error="llama-server process died")


@pytest.mark.parametrize("batch, good, broken", [
    ([TOK], [TOK], None),
    ([TOK, TOK], [TOK, TOK], None),
    ([TOK, END], [TOK, END], None),
    ([END], [END], None),
    ([TOK, ERR], [TOK], "llama-server process died"),  # the tokens before it are relayed, then a hand-over
    ([ERR], [], "llama-server process died"),
    ([Chunk(finish_reason="error")], [], "generation failed"),
], ids=["one", "two", "final", "final-alone", "error-after-tokens", "error-alone", "error-without-text"])
def test_until_end(batch, good, broken):
    assert _until_end(batch) == (good, broken)
    assert _scan_to_end(batch) == (good, broken)  # the form without the fast path (the bench's before-form)


def test_cost_bench_runs_every_case(capsys):
    assert migration_cost.main(["--repeats", "1", "--chunks", "50", "--per-batch", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [line.split("  ")[0] for line in lines] == list(migration_cost.cases(migration_cost.worker_stream(4, 1, 1)))
    assert all("ns CPU per chunk" in line for line in lines)
