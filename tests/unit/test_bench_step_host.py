"""bench/step_host.py: its parts run the real code on decode steps and leave the sequences as they found them."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench import step_host
from workers.cupy import engine


def test_emit_part_runs_append_tokens_and_takes_the_tokens_back():
    step, _ = step_host.decode_step(3, 40, two_pools=False)
    before = [list(seq.token_ids) for seq, _ in step]
    out = step_host.output_loop(engine)(step, step_host.BLOCK, np)
    assert [o.token_ids for o in out] == [[1000], [1001], [1002]]
    assert [o.completion_tokens for o in out] == [1, 1, 1]  # the step's sequences have 40 prompt tokens
    assert all(o.finish_reason is None for o in out)
    assert [list(seq.token_ids) for seq, _ in step] == before


def test_a_baseline_engine_file_is_timed_beside_this_tree(capsys):
    path = str(Path(engine.__file__))
    assert step_host.main(["--part", "emit", "--baseline", path, "--batches", "4", "--repeats", "1",
                           "--calls", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 4 |")]
    assert len(rows) == 2 and all(len(r.split("|")) == 7 for r in rows)  # batch, pools, two timings, ratio
    assert step_host.main(["--batches", "4", "--repeats", "1", "--calls", "2"]) == 0


def test_the_step_part_runs_whole_engine_steps_with_overlap_on_and_off(capsys):
    on = step_host.whole_step(3, 40, two_pools=True, overlap=True)
    outs = [on(None, step_host.BLOCK, np) for _ in range(4)]
    assert [len(o) for o in outs] == [3, 3, 3, 3] and all(t.token_ids == [7] for o in outs for t in o)
    assert step_host.main(["--part", "step", "--batches", "4", "--repeats", "1", "--calls", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 4 |")]
    assert len(rows) == 2 and all(len(r.split("|")) == 7 for r in rows)


def test_the_spec_part_keeps_a_copys_drafts_and_breaks_them_where_the_model_leaves_the_copy(capsys):
    # a pure copy: after the first requests warm the acceptance, most steps emit K + 1 tokens, and every
    # emitted token is the cycle's successor of the one before (speculation never changes the tokens)
    copy = step_host.spec_step(1, 8, 64, 0)
    outs = [copy(None, step_host.BLOCK, np) for _ in range(60)]
    by_request: dict = {}
    for o in outs:
        for out in o:
            by_request.setdefault(out.request_id, []).extend(out.token_ids)
    assert copy.tokens == sum(map(len, by_request.values())) and copy.tokens / copy.steps > 4
    assert max(len(out.token_ids) for o in outs for out in o) == 9
    succ = step_host.CopyModel.SUCC
    assert all(succ[a] == b for tokens in by_request.values() for a, b in zip(tokens, tokens[1:]))
    off = step_host.spec_step(1, None, 64, 0)
    [off(None, step_host.BLOCK, np) for _ in range(60)]
    assert off.tokens == off.steps  # one token a step (a prefill step emits its first)
    # leaving the copy every 5 positions: no draft is kept whole, fewer tokens a step
    broken = step_host.spec_step(1, 8, 64, 5)
    [broken(None, step_host.BLOCK, np) for _ in range(60)]
    assert 1 < broken.tokens / broken.steps < copy.tokens / copy.steps
    assert step_host.main(["--part", "spec", "--k", "4", "--batches", "2", "--repeats", "1", "--calls", "3"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 1 and len(rows[0].split("|")) == 8  # batch, pools, two timings, ratio, tokens a step


def missing_copy(monkeypatch, refuse=None):
    """A speculative step over a model that never continues its prompt's copy (--miss 1), every prompt-lookup
    search failing; returns (the step, the step count at each search). `refuse(engine)` may change the engine."""
    from workers.cupy import drafter

    searched: list[int] = []
    real = drafter.Drafter.propose

    def counting(self, tokens, k):
        searched.append(step.steps)
        return real(self, tokens, k)
    monkeypatch.setattr(drafter.Drafter, "propose", counting)
    step = step_host.spec_step(1, 8, 60, miss=1)
    if refuse is not None:
        refuse(step.engine)
    return step, searched


def search_gaps_ok(searched: list[int]) -> bool:
    """The searches come 1, 2, 4, then MISS_WAIT_MAX steps apart (a gap of wait + 1 steps)."""
    from workers.cupy import speculative

    gaps = [b - a for a, b in zip(searched, searched[1:])]
    cap = speculative.MISS_WAIT_MAX
    return gaps[:5] == [2, 3, 5, cap + 1, cap + 1] and set(gaps[3:]) == {cap + 1}


def test_failed_searches_wait_one_two_four_then_the_cap_and_those_steps_run_ahead(monkeypatch):
    """Every prompt-lookup search fails, so the searches come 1, 2, 4, then MISS_WAIT_MAX steps apart, the steps
    between are launched ahead, and the tokens are those of speculation off."""
    step, searched = missing_copy(monkeypatch)
    tokens = []
    for _ in range(61):  # the prefill step, then 60 decode steps (one token each: no draft is ever found)
        tokens += [t for out in step(None, step_host.BLOCK, np) for t in out.token_ids]
    assert search_gaps_ok(searched), searched
    assert step.engine.steps_ahead > 40
    off = step_host.spec_step(1, None, 60, miss=1)
    plain = [t for _ in range(61) for out in off(None, step_host.BLOCK, np) for t in out.token_ids]
    assert tokens == plain


def _refuse_blocks(engine):
    import sys

    take = engine.blocks.can_take
    # only the launch ahead is refused: the scheduler's own allocations go on as before
    engine.blocks.can_take = lambda need: sys._getframe(1).f_code.co_name != "_launch_ahead" and take(need)


def _refuse_draws(engine):
    engine.sampler.hold = lambda logits, rows: None


@pytest.mark.parametrize("refuse", [_refuse_blocks, _refuse_draws])
def test_a_waiting_step_that_cannot_launch_ahead_is_counted_once(monkeypatch, refuse):
    """When the step after a failed search cannot be launched ahead (no free blocks for it, or draws the sampler
    cannot hold: _launch_ahead checks both after asking the speculator), it runs as an ordinary step, and its wait
    is counted by that step only: the searches still come 1, 2, 4, then MISS_WAIT_MAX steps apart (before the
    split of skip_drafts and skipped: 1, 2, 3, 5, 5)."""
    step, searched = missing_copy(monkeypatch, refuse)
    for _ in range(61):
        step(None, step_host.BLOCK, np)
    assert search_gaps_ok(searched), searched
    assert step.engine.steps_ahead == 0
