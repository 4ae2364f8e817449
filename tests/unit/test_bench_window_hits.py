"""bench/window_hits.py: the earlier pool split it keeps for comparison, edited-turn detection on the routing
trace, and a small replay through the real BlockManager + Scheduler where the old release rule loses the
edited turn's hit and the current one keeps it."""
from bench.routing import TraceSpec, build_trace
from bench.window_hits import OldBlockManager, edited_turns, old_plan, replay, summarize
from workers.cupy.kv_cache import BlockManager, plan_pools

GEMMA = [(i + 1) % 6 == 0 for i in range(18)]


def test_old_plan_is_the_capped_split_and_the_new_one_gives_finished_windows_more():
    old = old_plan(3000, 16, GEMMA, 512, 8, 2048)
    assert (old.num_global, old.num_local) == (14640, 8 * 35 + 128 + 8 * 33)  # the split the H200 replay ran
    new = plan_pools(3000, 16, GEMMA, 512, 8, 2048)
    assert new.num_local > old.num_local and new.num_global < old.num_global
    assert old_plan(256, 16, GEMMA, 512, 2, 128) == plan_pools(256, 16, GEMMA, 512, 2, 128)  # third binds


def test_edited_turns_are_the_turns_whose_history_changed():
    trace = build_trace(TraceSpec(sessions=4, turns=8, edit_prob=0.5), "t")
    edited = edited_turns(trace)
    assert edited and all(t >= 2 for _, t in edited)  # edits start at the 3rd turn
    for s, turns in enumerate(trace):
        for t in range(1, len(turns)):
            prev, cur = turns[t - 1][1], turns[t][1]
            assert ((s, t) in edited) == any(a != b for a, b in zip(prev, cur))


def test_replay_old_rule_loses_the_edited_turns_hit_and_the_new_rule_keeps_it():
    # two sessions on one worker, block 4, window 16. Session 0: turn ends every 24 tokens, turn 6 edits token
    # 69 (after the turn end at 68). Session 1's turn 5 is a long prompt that churns the local pool.
    base = list(range(140))
    prompts = {(0, t): base[: 20 + 24 * t] for t in range(6)}
    edited = list(base[:140]) + [1, 2]
    edited[69] = 77_777
    prompts[0, 6] = edited
    prompts.update({(1, t): [50_000 + t] * 8 for t in range(7)})
    prompts[1, 5] = [60_000 + i for i in range(400)]
    sizes = {"max_num_seqs": 2, "max_step_tokens": 16}
    hits = {}
    for name, cls in (("old", OldBlockManager), ("new", BlockManager)):
        cached = replay(prompts, 2, 7, 1, lambda c=cls: c(2000, 4, num_local=48, window=16), sizes, 2)
        hits[name] = [cached[0, t] for t in range(7)]
    assert hits["new"][:6] == hits["old"][:6] == [0, 20, 44, 68, 92, 116]
    assert hits["new"][6] == 68 > hits["old"][6]
    row = summarize("x", prompts, {k: 0 for k in prompts}, {(0, 6)})
    assert row["edited"] == len(edited) and row["edited_n"] == 1 and row["first_n"] == 2
