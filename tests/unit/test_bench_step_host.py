"""bench/step_host.py: its parts run the real code on decode steps and leave the sequences as they found them."""
from __future__ import annotations

from pathlib import Path

import numpy as np

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
