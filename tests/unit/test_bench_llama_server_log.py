"""bench.llama_server_log on lines of a real llama-server log (the H200 parity run, 2026-12-01, build 11434)."""
from __future__ import annotations

import pytest

from bench import llama_server_log as sl

LOG = """\
=== 2026-12-01T20:44:52 /root/lb/build/bin/llama-server -m gemma.gguf -np 64 -c 65536 --cache-ram -1 --log-timestamps
0.16.047.612 I slot get_availabl: id 63 | task -1 | selected slot by LRU, t_last = -1
0.16.047.774 I slot launch_slot_: id 63 | task 0 | processing task, is_child = 0
0.16.410.898 I slot print_timing: id 63 | task 0 | prompt eval time =     200.53 ms /    32 tokens (    6.27 ms per token,   159.58 tokens per second)
0.16.410.904 I slot print_timing: id 63 | task 0 |        eval time =     161.88 ms /    18 tokens (    9.52 ms per token,   105.02 tokens per second)
0.16.411.115 I slot      release: id 63 | task 0 | stop processing: n_tokens = 49, truncated = 0
0.21.170.709 I slot get_availabl: id  0 | task -1 | selected slot by LCP similarity, f_sim_best = 1.000 (> 0.100 thold), f_keep = 0.201
0.21.222.522 I slot launch_slot_: id  0 | task 550 | processing task, is_child = 0
0.21.222.549 I slot get_availabl: id  1 | task -1 | selected slot by id (1)
0.21.223.049 I slot launch_slot_: id  1 | task 551 | processing task, is_child = 0
1.02.000.000 I slot print_timing: id  0 | task 550 | prompt eval time =     330.00 ms /     5 tokens (   66.00 ms per token,    15.15 tokens per second)
1.02.000.001 I slot print_timing: id  0 | task 550 |        eval time =    3000.00 ms /   120 tokens (   25.00 ms per token,    40.00 tokens per second)
"""


def test_parse_times_each_launch_from_its_pick():
    launches = sl.parse(LOG.splitlines())
    assert [(x.task, x.slot, x.pick) for x in launches] == [(0, 63, "lru"), (550, 0, "similarity"), (551, 1, "id")]
    lru, sim, pinned = launches
    assert lru.wait_ms == pytest.approx(0.162) and lru.f_keep is None
    assert sim.wait_ms == pytest.approx(51.813) and sim.f_keep == pytest.approx(0.201)  # a save into the RAM cache
    assert pinned.wait_ms == pytest.approx(0.5)
    assert (lru.prompt_ms, lru.prompt_tokens, lru.ms_per_token) == (200.53, 32, pytest.approx(161.88 / 18))
    assert (sim.prompt_ms, sim.ms_per_token) == (330.0, 25.0)  # minutes roll over: 1.02.000 is 62 s
    assert pinned.prompt_ms is None and pinned.ms_per_token is None  # still running when the log ends


def test_summary_per_pick_and_its_lines():
    summary = sl.summarize(sl.parse(LOG.splitlines()))
    assert set(summary) == {"lru", "similarity", "id"}
    assert summary["similarity"]["n"] == 1 and summary["similarity"]["wait_p50_ms"] == pytest.approx(51.813)
    assert summary["id"]["prompt_p50_ms"] is None
    text = "\n".join(sl.lines(summary))
    assert "picked by similarity: 1, launch wait p50 51.81 ms" in text and "prompt eval p50 - ms" in text


def test_a_deferred_pick_is_timed_from_its_retry():
    log = ("0.01.000.000 I slot get_availabl: id  2 | task -1 | selected slot by id (2)\n"
           "0.01.500.000 I slot get_availabl: id  2 | task -1 | selected slot by id (2)\n"
           "0.01.500.200 I slot launch_slot_: id  2 | task 9 | processing task, is_child = 0\n"
           "a line without a timestamp\n")
    (launch,) = sl.parse(log.splitlines())
    assert launch.task == 9 and launch.wait_ms == pytest.approx(0.2)
