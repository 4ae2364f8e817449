"""The engine's overlap (engine.py, `overlap`): each step launched before the one before it is read, the next
step's inputs taken from the held draws. On the real bundled model (NumPy, CPU), where the draw is made at once,
so these tests check the bookkeeping (placeholders, sequences finished by length before the read, rows dropped
after a stop token, cancellation in between, waiting requests joining a step launched ahead) against the same
requests run one step at a time: the same tokens, the same finishes, the same usage."""
from __future__ import annotations

from collections import defaultdict

import pytest

from policy.profiles import DeviceProfile, SpeculationRule
from policy.speculation import SpeculationGate
from tests.integration.engine_helpers import PROMPTS, encode, make_engine
from workers.cupy.engine import PENDING
from workers.cupy import speculative
from workers.cupy.speculative import Speculator
from workers.protocol import GenerateRequest, SamplingParams

T1 = SamplingParams(temperature=1.0, seed=7)


def drive(engine, requests: list[GenerateRequest], abort_at: dict[str, int] | None = None):
    """Step until done; `abort_at`: {request id: step count after which it is cancelled}. Returns (tokens by
    request, final output by request)."""
    for r in requests:
        engine.add(r)
    tokens, final, steps = defaultdict(list), {}, 0
    while engine.has_work():
        for out in engine.step():
            assert out.request_id not in final, "output after a request's final one"
            tokens[out.request_id] += out.token_ids
            if out.finish_reason:
                final[out.request_id] = out
        steps += 1
        for rid, at in (abort_at or {}).items():
            if at == steps:
                out = engine.abort(rid)
                if out is not None:
                    final[rid] = out
    return dict(tokens), final


def requests(sampling=T1, lengths=(5, 9, 3, 12, 7), **kw):
    prompts = [encode(p) for p in PROMPTS]
    return [GenerateRequest(request_id=f"r{i}", prompt_ids=prompts[i % len(prompts)], max_tokens=n,
                            sampling=sampling, **({"ignore_eos": True} | kw)) for i, n in enumerate(lengths)]


def both(reqs_fn, **engine_kw):
    off = make_engine(**engine_kw)
    on = make_engine(overlap=True, **engine_kw)
    return drive(off, reqs_fn()), drive(on, reqs_fn()), on


def same_usage(a, b):
    assert set(a) == set(b)
    for rid in a:
        assert (a[rid].finish_reason, a[rid].completion_tokens, a[rid].prompt_tokens) == \
            (b[rid].finish_reason, b[rid].completion_tokens, b[rid].prompt_tokens), rid


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), T1], ids=["greedy", "t1"])
def test_overlap_gives_the_same_tokens_with_finishes_by_length_at_different_steps(sampling):
    (ref, ref_final), (got, got_final), on = both(lambda: requests(sampling))
    assert on.steps_ahead > 0, "no step was launched ahead: the test would not check anything"
    assert got == ref
    same_usage(ref_final, got_final)
    assert all(len(got[r]) == got_final[r].completion_tokens for r in got)


def test_waiting_requests_join_steps_launched_ahead():
    """Eight requests through a 3-sequence engine: slots freed by a finish by length are taken by waiting
    requests in the step launched ahead, and every request gets the tokens it gets one step at a time."""
    lengths = (4, 6, 3, 9, 5, 2, 8, 4)
    (ref, ref_final), (got, got_final), on = both(lambda: requests(T1, lengths), max_num_seqs=3)
    assert on.steps_ahead > 0
    assert got == ref
    same_usage(ref_final, got_final)


def test_a_stop_token_ends_the_request_where_it_would_have_and_drops_the_row_launched_ahead():
    """Each request's third token (from a run one step at a time) made its stop token: with overlap the step
    after it was already launched, and its row there is dropped: the same tokens, finish "stop"."""
    plain = make_engine()
    first, _ = drive(plain, requests(lengths=(10, 10, 10)))
    stops = {rid: toks[2] for rid, toks in first.items()}

    def reqs():
        return [GenerateRequest(request_id=r.request_id, prompt_ids=r.prompt_ids, max_tokens=10, sampling=T1,
                                stop_token_ids=[stops[r.request_id]])
                for r in requests(lengths=(10, 10, 10))]
    (ref, ref_final), (got, got_final), on = both(reqs)
    assert on.steps_ahead > 0
    assert got == ref
    same_usage(ref_final, got_final)
    for rid, toks in got.items():
        assert got_final[rid].finish_reason == "stop" and toks[-1] == stops[rid] and len(toks) <= 3
    assert not on.seqs and not on.scheduler.running and on.blocks.num_used == 0


def test_cancelling_while_a_step_is_launched_ahead_keeps_the_others_and_the_usage_right():
    lengths = (12, 12, 12)
    on = make_engine(overlap=True)
    tokens, final = drive(on, requests(lengths=lengths), abort_at={"r1": 4})
    assert on.steps_ahead > 0
    off = make_engine()
    ref, _ = drive(off, requests(lengths=lengths), abort_at={"r1": 4})
    assert tokens["r0"] == ref["r0"] and tokens["r2"] == ref["r2"]
    assert final["r1"].finish_reason == "cancelled"
    assert final["r1"].completion_tokens == len(tokens["r1"]), "usage counts a placeholder, or loses a token"
    assert tokens["r1"] == ref["r1"][: len(tokens["r1"])]
    assert all(PENDING not in s.token_ids for s in on.seqs.values())
    assert on.blocks.num_used == 0


def test_steps_that_need_the_host_between_them_are_not_launched_ahead():
    """Logprobs and penalties need the host's view of each step (and grammar-constrained rows their matcher):
    such batches run one step at a time, with the same tokens as without overlap."""
    lp = lambda: requests(logprobs=0)  # noqa: E731
    (ref, _), (got, _), on = both(lp)
    assert got == ref and on.steps_ahead == 0
    pen = lambda: requests(SamplingParams(temperature=1.0, seed=3, frequency_penalty=0.5))  # noqa: E731
    (ref, _), (got, _), on = both(pen)
    assert got == ref and on.steps_ahead == 0


def test_speculation_that_may_draft_keeps_steps_in_order_and_one_that_cannot_lets_them_overlap(monkeypatch):
    """With every step searching for a draft (no wait after a failed search) none is launched ahead."""
    monkeypatch.setattr(speculative, "MISS_WAIT_MAX", 0)
    drafting = DeviceProfile(name="k4", max_draft_tokens=4, draft_token_cost=0.0,
                             speculation=[SpeculationRule(max_context=10**9, k=4)])
    never = DeviceProfile(name="k0", max_draft_tokens=4, draft_token_cost=0.0,
                          speculation=[SpeculationRule(max_context=10**9, k=0)])
    greedy = SamplingParams(temperature=0.0)
    ref, _ = drive(make_engine(), requests(greedy))
    for profile, ahead in ((drafting, False), (never, True)):
        on = make_engine(overlap=True)
        on.speculator = Speculator(profile)
        got, _ = drive(on, requests(greedy))
        assert got == ref
        assert (on.steps_ahead > 0) is ahead, profile.name


@pytest.mark.parametrize("sampling", [T1, SamplingParams(temperature=0.0)], ids=["t1", "greedy"])
def test_a_search_that_finds_nothing_waits_and_the_steps_between_overlap(sampling):
    """On the real model's text: after a prompt-lookup search finds no draft the sequence waits before the next
    (MISS_WAIT_MAX; the exact waits: tests/unit/test_bench_step_host.py), the steps between are launched ahead,
    drafts found between them are still verified, and the tokens are plain decoding's."""
    drafting = DeviceProfile(name="k4", max_draft_tokens=4, draft_token_cost=0.0,
                             speculation=[SpeculationRule(max_context=10**9, k=4)])
    lengths = (60, 45)
    ref, ref_final = drive(make_engine(), requests(sampling, lengths))
    on = make_engine(overlap=True)
    on.speculator = spec = Speculator(drafting)
    got, final = drive(on, requests(sampling, lengths))
    assert got == ref
    same_usage(ref_final, final)
    assert on.steps_ahead > 0, "no step ran ahead between failed searches"
    assert sum(spec.steps_by_k[1:]) > 0, "nothing drafted"


@pytest.mark.parametrize("gate", [False, True], ids=["no-gate", "gate-drafting"])
def test_drafting_on_with_acceptance_saying_no_lets_steps_overlap_between_probes(gate):
    """Drafting on (no gate, or the gate's drafting mode), but every sequence's acceptance says depth 0: a drafted
    token costs a whole step here (draft_token_cost 1), so no depth pays at the prior. Those steps draft nothing
    whatever the latest token is, so they are launched ahead; the probe every PROBE_EVERY such steps still
    drafts (one step at a time), and the tokens are the ones plain decoding gives. Before, drafting on kept every
    step in order (sampled text while the gate explored drafting lost the overlap for nothing)."""
    costly = DeviceProfile(name="k4-costly", max_draft_tokens=4, draft_token_cost=1.0,
                           speculation=[SpeculationRule(max_context=10**9, k=4)])
    lengths = (5, 9, 3, 80, 7, 70)  # two long enough for probes (PROBE_EVERY decode steps)
    for sampling in (T1, SamplingParams(temperature=0.0)):
        ref, ref_final = drive(make_engine(), requests(sampling, lengths))
        on = make_engine(overlap=True)
        on.speculator = spec = Speculator(costly, gate=gate)
        if gate:  # an epoch longer than the run: the gate stays in drafting mode, as while it explores drafting
            spec.gate = SpeculationGate(epoch_steps=10**9)
        got, final = drive(on, requests(sampling, lengths))
        assert got == ref
        same_usage(ref_final, final)
        assert on.steps_ahead > 0
        assert spec.steps_by_k[1] > 0, "the probes stopped"


def test_the_prefix_cache_gets_the_same_blocks_with_chunked_prompts_joining_steps_launched_ahead():
    """A small step budget chunks the prompts of requests that join steps launched ahead: every block each run
    filled is hashed into the prefix cache (and announced) as one step at a time does it."""
    lengths = (20, 3, 17, 5, 30, 9)

    def added(engine_kw):
        events = []
        engine = make_engine(block_sink=events.append, max_num_seqs=2, max_step_tokens=24, **engine_kw)
        tokens, _ = drive(engine, requests(T1, lengths))
        return tokens, {h for e in events if e.kind == "added" for h in e.hashes}, engine

    ref, ref_added, _ = added({})
    got, got_added, on = added({"overlap": True})
    assert on.steps_ahead > 0
    assert got == ref
    assert got_added == ref_added and ref_added


def test_speculation_state_of_ended_requests_is_dropped_while_steps_run_ahead():
    """Steps launched ahead never call propose(); the speculator still forgets requests that ended, so its state
    stays bounded by the running batch however many requests pass through."""
    never = DeviceProfile(name="k0", max_draft_tokens=4, draft_token_cost=0.0,
                          speculation=[SpeculationRule(max_context=10**9, k=0)])
    on = make_engine(overlap=True, max_num_seqs=3)
    on.speculator = spec = Speculator(never)
    drive(on, requests(lengths=(3, 4, 2, 5, 3, 2, 4, 3, 2, 5, 3, 4)))
    assert on.steps_ahead > 10
    assert len(spec._seqs) <= 3, f"{len(spec._seqs)} requests' speculation state kept after they ended"


def test_the_step_thread_times_its_steps_and_the_waits_for_their_tokens():
    """step_seconds and token_wait_seconds (engine_snapshot's fields; bench/served.py's step_busy and wait_share)
    advance with every step, overlapped or not, and the wait is a part of the step time."""
    from workers.cupy.engine_loop import engine_snapshot

    for overlap in (False, True):
        eng = make_engine(overlap=overlap)
        assert (eng.step_seconds, eng.token_wait_seconds) == (0.0, 0.0)
        drive(eng, requests(T1, (4, 6)))
        snap = engine_snapshot(eng)
        assert 0.0 < snap["token_wait_seconds"] < snap["step_seconds"] == eng.step_seconds
        parts = snap["step_phase_seconds"]
        for name in ("schedule", "build", "forward", "append", "commit"):
            assert parts[name] > 0.0, name
        # the parts inside a step, with the wait, are at most the step time (the rest: the step's own glue)
        inside = sum(parts[k] for k in ("schedule", "build", "forward", "append", "commit", "speculate"))
        assert inside + snap["token_wait_seconds"] <= snap["step_seconds"]


def test_a_verify_steps_wait_for_its_ids_is_counted_as_waiting_not_as_speculation(monkeypatch):
    """A speculative step's wait for the sampler's ids (on a GPU: the device) goes to token_wait_seconds as a plain
    step's does, and out of the `speculate` phase (before, bench/served.py's per-run line read a device-bound
    speculative step as host work). Each choose here takes a known 4 ms more."""
    import time

    monkeypatch.setattr(speculative, "MISS_WAIT_MAX", 0)
    drafting = DeviceProfile(name="k4", max_draft_tokens=4, draft_token_cost=0.0,
                             speculation=[SpeculationRule(max_context=10**9, k=4)])
    eng = make_engine()
    eng.speculator = spec = Speculator(drafting)
    real_choose, real_verify, calls = eng.sampler.sample, spec.verify, {"choose": 0, "verify": 0}

    def choose(*a, **kw):  # the sampler's draw, inside Engine.choose
        calls["choose"] += 1
        time.sleep(0.004)
        return real_choose(*a, **kw)

    def verify(*a, **kw):
        calls["verify"] += 1
        return real_verify(*a, **kw)
    eng.sampler.sample, spec.verify = choose, verify
    drive(eng, requests(SamplingParams(temperature=0.0), (60, 45)))
    assert calls["verify"] > 3, "nothing drafted"
    assert eng.token_wait_seconds >= 0.004 * calls["choose"]
    parts = eng.phase_seconds
    inside = sum(parts[k] for k in ("schedule", "build", "forward", "append", "commit", "speculate"))
    assert inside + eng.token_wait_seconds <= eng.step_seconds


def test_the_loop_times_its_hand_overs_between_steps():
    """EngineLoop adds the time it spends handing outputs over to the engine's phase_seconds["handover"]."""
    import threading
    import time

    from workers.cupy.engine_loop import STOP, EngineLoop

    eng = make_engine(overlap=True)
    finals: list = []
    loop = EngineLoop(eng, emit=lambda outs: finals.extend(o for o in outs if o.finish_reason),
                      emit_one=lambda rid, item: None)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    for r in requests(T1, (4, 6)):
        loop.inbox.put(("add", r))
    deadline = time.monotonic() + 120
    while len(finals) < 2:
        assert time.monotonic() < deadline, "the requests did not finish"
        time.sleep(0.01)
    loop.inbox.put((STOP, None))
    thread.join(60)
    assert not thread.is_alive()
    assert eng.phase_seconds["handover"] > 0.0
