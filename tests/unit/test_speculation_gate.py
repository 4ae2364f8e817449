"""The speculation gate (policy.speculation.SpeculationGate): per concurrency bucket, prompt-lookup drafting
stays on only where the engine's own decode steps measured faster with it. Driven with step timings
given here (the gate only keeps books; the engine's timing of real steps is in test_speculation.py)."""
from __future__ import annotations

import pytest

from policy.speculation import GATE_BACKOFF_MAX, GATE_CLEAR_RATIO, GATE_CLEAR_SLOWER, SpeculationGate

EPOCH, EXPLORE = 4, 8


def run(gate: SpeculationGate, concurrency: int, steps: int, rate_on: float, rate_off: float) -> list[bool]:
    """`steps` decode steps at `concurrency`, each emitting `concurrency` tokens at the mode's rate
    (tokens per second); the mode of each step."""
    modes = []
    for _ in range(steps):
        on = gate.drafting(concurrency)
        modes.append(on)
        gate.observe(concurrency, on, concurrency, concurrency / (rate_on if on else rate_off))
    return modes


def test_starts_drafting_then_measures_the_other_mode():
    gate = SpeculationGate(EPOCH, EXPLORE)
    modes = run(gate, 1, 2 * EPOCH, 100.0, 150.0)
    assert modes == [True] * EPOCH + [False] * EPOCH
    snap = gate.snapshot()[1]
    assert snap["on"] == pytest.approx(100.0) and snap["off"] == pytest.approx(150.0)


@pytest.mark.parametrize("rate_on, rate_off, keep, every", [
    (100.0, 150.0, False, EXPLORE),  # a close call: the first re-try of the other mode EXPLORE epochs on
    (150.0, 100.0, True, EXPLORE),
    (300.0, 100.0, True, EXPLORE * GATE_CLEAR_SLOWER),  # a clear winner (code at one stream): rarer
    (100.0, 100.0 * GATE_CLEAR_RATIO, False, EXPLORE * GATE_CLEAR_SLOWER),
])
def test_keeps_the_faster_mode_and_explores_the_other_ever_more_rarely(rate_on, rate_off, keep, every):
    """Each re-try that finds the other mode still worse doubles the wait for the next, up to a cap."""
    gate = SpeculationGate(EPOCH, EXPLORE)
    total = 2 + 20 * every  # the two measuring epochs, then enough to reach the cap
    modes = run(gate, 1, total * EPOCH, rate_on, rate_off)
    assert all(len(set(modes[i:i + EPOCH])) == 1 for i in range(0, len(modes), EPOCH))  # whole epochs
    tried = [i + 1 for i in range(2, total) if modes[i * EPOCH] != keep]  # 1-based epoch numbers
    expected, at, n = [], 2, 0
    while True:
        at += every << min(n, GATE_BACKOFF_MAX)
        if at > total:
            break
        expected.append(at)
        n += 1
    assert tried == expected
    assert len(expected) >= 3 and expected[-1] - expected[-2] == every << GATE_BACKOFF_MAX  # the cap reached


def test_follows_a_change_in_the_traffic():
    """Text (drafting loses), then a code edit (drafting wins): the exploring epochs see the change."""
    gate = SpeculationGate(EPOCH, EXPLORE)
    run(gate, 1, 20 * EPOCH, 100.0, 150.0)
    assert not gate.drafting(1)
    modes = run(gate, 1, 40 * EPOCH, 400.0, 150.0)
    assert all(modes[-EXPLORE * EPOCH + EPOCH:][:EPOCH])  # on again well before the end
    assert sum(modes[-EXPLORE * EPOCH:]) >= (EXPLORE - 1) * EPOCH


def test_a_retry_that_wins_switches_and_starts_the_waits_over():
    gate = SpeculationGate(EPOCH, EXPLORE)
    run(gate, 1, 60 * EPOCH, 100.0, 150.0)  # text: re-tries of drafting at epochs 10, 26 and 58 (waits 8, 16, 32)
    st = gate._state(1)
    assert not gate.drafting(1) and st.confirmed == 3 and st.next_explore == 58 + EXPLORE * 8 - 1
    modes = run(gate, 1, (122 - 60) * EPOCH, 400.0, 150.0)  # a code edit from epoch 61: re-tried at epoch 122
    assert not any(modes[:-EPOCH]) and all(modes[-EPOCH:])
    assert gate.drafting(1) and st.confirmed == 0  # drafting won there: on, and the waits from EXPLORE again
    assert st.next_explore == 122 + EXPLORE - 1


def test_buckets_are_independent():
    gate = SpeculationGate(EPOCH, EXPLORE)
    run(gate, 1, 20 * EPOCH, 300.0, 100.0)  # one stream: drafting pays
    run(gate, 32, 20 * EPOCH, 5000.0, 9000.0)  # 32 streams: it does not
    assert gate.snapshot()[1]["on"] > gate.snapshot()[1]["off"]
    assert gate.snapshot()[32]["off"] > gate.snapshot()[32]["on"]
    assert gate.bucket(32) == gate.bucket(63) != gate.bucket(64)


def test_steps_of_the_other_mode_and_empty_timings_are_not_counted():
    gate = SpeculationGate(EPOCH, EXPLORE)
    for _ in range(3 * EPOCH):
        gate.observe(1, False, 1, 0.01)  # the bucket is drafting: an off step is someone else's
        gate.observe(1, True, 1, 0.0)
    assert gate.drafting(1) and gate.snapshot()[1]["on"] is None


def test_rates_are_per_running_sequence_so_a_bigger_batch_in_the_bucket_does_not_win():
    """32 and 63 sequences share a bucket: drafting measured at 32, plain decoding at 63, each step the same
    time, is a tie per sequence, not a 2x win for whichever mode ran the bigger batch."""
    gate = SpeculationGate(EPOCH, EXPLORE)
    for conc in (32, 63):
        for _ in range(EPOCH):
            gate.observe(conc, gate.drafting(conc), conc, 0.01)
    snap = gate.snapshot()[32]
    assert snap["on"] == pytest.approx(snap["off"]) == pytest.approx(100.0)


def test_sampled_batches_keep_books_of_their_own():
    """Greedy text drafts to a win at 8 streams while the same text sampled at temperature 1 loses (the H200's
    served table): a bucket taught by greedy traffic must not decide for sampled traffic, and the other way."""
    gate = SpeculationGate(EPOCH, EXPLORE)

    def run_kind(sampled: bool, steps: int, rate_on: float, rate_off: float) -> None:
        for _ in range(steps):
            on = gate.drafting(8, sampled)
            gate.observe(8, on, 8, 8 / (rate_on if on else rate_off), sampled)

    run_kind(False, 20 * EPOCH, 1600.0, 1000.0)
    run_kind(True, 20 * EPOCH, 870.0, 1000.0)
    assert gate.drafting(8) and not gate.drafting(8, sampled=True)
    snap = gate.snapshot()
    assert snap[8]["on"] > snap[8]["off"] and snap["8 sampled"]["off"] > snap["8 sampled"]["on"]
