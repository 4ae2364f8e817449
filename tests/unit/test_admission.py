"""policy.admission on tables of cases, the drain-rate meter, and properties."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy.admission import (
    DrainRate,
    admit,
    expired,
    gateway_order,
    kv_tokens_needed,
    over_share,
    retry_after,
    waits_on_stats,
    worker_queue,
)
from policy.config import AdmissionConfig
from policy.types import AdmissionRequest, QueueState, WorkerLoad

CFG = AdmissionConfig(queue_max=10, queue_deadline_s=30, worker_queue_max=2, max_retry_after_s=60)


def W(running=0, waiting=0, slots=4, total=100, used=0, block=16, **kw) -> WorkerLoad:
    return WorkerLoad("w", running=running, waiting=waiting, slots=slots, kv_blocks_total=total,
                      kv_blocks_used=used, block_size=block, **kw)


def A(prompt=100, max_tokens=100, cached=0, priority=0, ctx=8192) -> AdmissionRequest:
    return AdmissionRequest(prompt, max_tokens, cached, priority, ctx)


def Q(depth=None, rate=0.0) -> QueueState:
    return QueueState(depth or {}, rate)


# (name, target, request, queue, cfg, (action, status, code))
CASES = [
    ("idle worker admits", W(), A(), Q(), CFG, ("admit", 200, "")),
    ("no worker: 503", None, A(), Q(), CFG, ("reject", 503, "no_healthy_worker")),
    ("unhealthy worker: 503", W(healthy=False), A(), Q(), CFG, ("reject", 503, "no_healthy_worker")),
    ("prompt over context: 400", W(), A(prompt=9000, ctx=8192), Q(), CFG, ("reject", 400, "context_length_exceeded")),
    ("prompt + max over context: 400", W(), A(prompt=8000, max_tokens=500), Q(), CFG,
     ("reject", 400, "context_length_exceeded")),
    ("prompt + max over context clamped", W(total=1000), A(prompt=8000, max_tokens=500), Q(),
     AdmissionConfig(clamp_max_tokens=True), ("admit", 200, "")),
    ("bigger than the whole KV: 400", W(total=10), A(prompt=100, max_tokens=100), Q(), CFG,
     ("reject", 400, "context_length_exceeded")),
    ("KV full: queue", W(used=95), A(), Q(), CFG, ("queue", 200, "")),
    ("cached prefix is credited", W(used=95), A(prompt=1000, max_tokens=10, cached=990, ctx=0), Q(), CFG,
     ("admit", 200, "")),
    ("unknown KV: slots decide", W(total=0, running=4, waiting=1), A(), Q(), CFG, ("admit", 200, "")),
    ("slots and worker queue full: queue", W(total=0, running=4, waiting=2), A(), Q(), CFG, ("queue", 200, "")),
    ("queue full: 429", W(used=100), A(), Q({0: 10}, 1.0), CFG, ("reject", 429, "server_overloaded")),
    ("does not overtake queued peers", W(), A(), Q({0: 1}), CFG, ("queue", 200, "")),
    ("overtakes lower priority", W(), A(priority=1), Q({0: 5}), CFG, ("admit", 200, "")),
    ("background gets a share of the queue", W(used=100), A(priority=-1), Q({0: 5}), CFG,
     ("reject", 429, "server_overloaded")),
    ("background queues below its share", W(used=100), A(priority=-1), Q({0: 4}), CFG, ("queue", 200, "")),
    ("hopeless queue says no at once", W(used=100), A(), Q({0: 9}, 0.1), CFG, ("reject", 429, "server_overloaded")),
    # the replicas' queues pooled: 3 others holding 12 of their 30 leave this one room past its own 10
    ("a replica queues past queue_max while the others leave room", W(used=100, other_gateways=3, gateways_waiting=12),
     A(), Q({0: 25}, 100.0), CFG, ("queue", 200, "")),
    ("the pooled queue full: 429", W(used=100, other_gateways=3, gateways_waiting=12), A(), Q({0: 28}, 100.0), CFG,
     ("reject", 429, "server_overloaded")),
    ("others over their own share leave a replica its queue_max", W(used=100, other_gateways=3, gateways_waiting=35),
     A(), Q({0: 9}, 100.0), CFG, ("queue", 200, "")),
    ("background gets its share of the pooled queue", W(used=100, other_gateways=1, gateways_waiting=0),
     A(priority=-1), Q({0: 10}, 100.0), CFG, ("reject", 429, "server_overloaded")),
]


@pytest.mark.parametrize("name,target,req,queue,cfg,want", CASES, ids=[c[0] for c in CASES])
def test_admission_table(name, target, req, queue, cfg, want):
    d = admit(target, req, queue, cfg)
    assert (d.action, d.status, d.code) == want, d
    if d.status in (429, 503):
        assert d.retry_after_s is not None and 1 <= d.retry_after_s <= cfg.max_retry_after_s
    if d.action == "queue":
        assert d.deadline_s == cfg.queue_deadline_s


SHARE_CFG = AdmissionConfig(queue_max=1000, worker_queue_max=0)


def share_of(demand: int, others_active: int, others_waiting: int, slots: int) -> int:
    """The places a gateway with `demand` requests (in flight there, or queued here: the one asking among them)
    takes before over_share says stop."""
    n = 0
    while n < demand and not over_share(
            W(total=0, running=others_active + n, slots=slots, inflight=n, polled_inflight=n,
              gateways_waiting=others_waiting), QueueState({}, 0.0, queued=demand - n), SHARE_CFG):
        n += 1
    return n


@pytest.mark.parametrize("demand, others_active, others_waiting, slots, want", [
    (8, 0, 4, 2, 1),  # 8 wanted here, 4 elsewhere, 2 places: 1.33 -> 1 (rounded up, both replicas kept 2)
    (4, 1, 7, 2, 1),  # the other side of it: 0.67 -> 1
    (250, 192, 558, 256, 64),  # 1,000 clients over 4 replicas, evenly: a quarter of 256
    (350, 192, 458, 256, 90),  # 350 of the 1,000 here: 89.6 places
    (1, 100, 5, 256, 1),  # one request here, few elsewhere: it goes
])
def test_over_share_splits_the_places_by_demand(demand, others_active, others_waiting, slots, want):
    assert share_of(demand, others_active, others_waiting, slots) == want


def test_without_others_waiting_nothing_changes():
    """One replica (or others with empty queues): the worker's free places decide, as before."""
    cfg = AdmissionConfig(queue_max=10, worker_queue_max=0)
    assert not over_share(W(running=3, slots=4, inflight=3, polled_inflight=3), QueueState({}, 0.0, queued=50), cfg)
    d = admit(W(total=0, running=3, slots=4, inflight=3, polled_inflight=3), A(), Q(), cfg)
    assert d.action == "admit"
    d = admit(W(total=0, running=3, slots=4, inflight=3, polled_inflight=3, gateways_waiting=20), A(), Q(), cfg)
    assert d.action == "queue"  # 4 places, 4 wanted here, 20 elsewhere: this gateway's share is 1 and it holds 3


ORDER_CFG = AdmissionConfig(queue_max=10, worker_queue_max=0, gateway_order_s=0.25)
# a free place (3 of 4 held, all this gateway's) and another replica with 2 queued; the asking request came at t=10
FREE = dict(total=0, running=3, slots=4, inflight=3, polled_inflight=3, gateways_waiting=2, other_gateways=1)


@pytest.mark.parametrize("name, theirs, mine, cfg, order, action", [
    ("no head of theirs waits for it: the shares decide", {}, {}, ORDER_CFG, 0, "queue"),
    ("their head came 1 s before: it goes first", dict(others_head_priority=0, others_head_since=9.0), {}, ORDER_CFG,
     -1, "queue"),
    ("within the margin: the shares decide", dict(others_head_priority=0, others_head_since=9.9), {}, ORDER_CFG, 0,
     "queue"),
    ("this one came 1 s before theirs: it goes whatever its share",
     dict(others_head_priority=0, others_head_since=11.0), {}, ORDER_CFG, 1, "admit"),
    ("theirs has a higher priority", dict(others_head_priority=1, others_head_since=11.0), {}, ORDER_CFG, -1, "queue"),
    ("this one has the higher priority", dict(others_head_priority=0, others_head_since=5.0), dict(priority=1),
     ORDER_CFG, 1, "admit"),
    ("the order off", dict(others_head_priority=0, others_head_since=11.0), {},
     AdmissionConfig(queue_max=10, worker_queue_max=0, gateway_order_s=None), 0, "queue"),
])
def test_the_replicas_heads_go_in_priority_then_arrival_order(name, theirs, mine, cfg, order, action):
    """This gateway holds 3 of the 4 places and has a queue of its own, so it is over its share (1 of 4 places
    against the other replica's 2 waiting): the shares alone leave the free place to the other replica. The order
    across replicas overrides that both ways: a head that came first elsewhere keeps the place even from a request
    within its share, and a request that came first takes it though its replica is over its share."""
    w, req, q = W(**FREE, **theirs), A(**mine), QueueState({}, 0.0, queued=3, since=10.0)
    assert gateway_order(w, req, q, cfg) == order
    assert admit(w, req, q, cfg).action == action
    within_share = W(**{**FREE, "running": 1, "inflight": 1, "polled_inflight": 1}, **theirs)
    assert admit(within_share, req, q, cfg).action == ("queue" if order < 0 else "admit")


def test_without_its_arrival_a_request_is_not_ordered_across_replicas():
    w = W(**FREE, others_head_priority=0, others_head_since=0.0)
    assert gateway_order(w, A(), QueueState({}, 0.0, queued=1), ORDER_CFG) == 0


@pytest.mark.parametrize("configured, said, want", [
    (None, None, 4),  # neither says: 4
    (None, 128, 128),  # the worker's profile (the h200's engine queue)
    (0, 128, 0),  # the operator's setting wins (the fairness tests hold every request in the gateway)
    (2, None, 2),
])
def test_worker_queue_is_the_operators_else_the_workers_else_4(configured, said, want):
    assert worker_queue(W(queue_max=said), AdmissionConfig(worker_queue_max=configured)) == want


def test_a_worker_that_holds_a_queue_is_sent_that_many_beyond_its_slots():
    cfg = AdmissionConfig(queue_max=10)  # worker_queue_max unset
    deep, plain = W(total=0, running=4, waiting=7, slots=4, queue_max=8), W(total=0, running=4, waiting=7, slots=4)
    assert admit(deep, A(), Q(), cfg).action == "admit"  # 11 of 4 + 8
    assert admit(plain, A(), Q(), cfg).action == "queue"  # 11 past 4 + 4
    assert admit(W(total=0, running=4, waiting=8, slots=4, queue_max=8), A(), Q(), cfg).action == "queue"


@pytest.mark.parametrize("name, target, want", [
    # this gateway holds every request the worker has: the end of one re-checks the queue, no poll needed
    ("own places", W(total=0, running=4, waiting=2, slots=4, inflight=6, polled_inflight=6), False),
    ("own places, KV to spare", W(running=4, waiting=2, slots=4, used=10, inflight=6, polled_inflight=6), False),
    # what only the worker's next stats show
    ("KV it frees", W(running=2, slots=4, used=95, inflight=2, polled_inflight=2), True),
    ("another replica shares it", W(total=0, running=6, slots=4, inflight=6, polled_inflight=6, other_gateways=1),
     True),
    ("another replica's queue", W(total=0, running=6, slots=4, inflight=6, polled_inflight=6, gateways_waiting=3),
     True),
    ("requests not its own", W(total=0, running=6, slots=4, inflight=4, polled_inflight=4), True),
    ("it refused", W(total=0, running=2, slots=4, inflight=2, polled_inflight=2, refused=True), True),
])
def test_a_queued_request_waits_on_the_stats_only_for_what_they_alone_show(name, target, want):
    cfg = AdmissionConfig(queue_max=10, worker_queue_max=2)
    assert admit(target, A(ctx=0), Q(), cfg).action == "queue", name
    assert waits_on_stats(target, A(ctx=0), cfg) is want, name
    assert waits_on_stats(None, A(ctx=0), cfg)


def test_overflow_messages_say_by_how_much():
    d = admit(W(), A(prompt=8000, max_tokens=500, ctx=8192), Q(), CFG)
    assert "8500" in d.message and "308 over" in d.message and "at most 192" in d.message
    d = admit(W(), A(prompt=8200, ctx=8192), Q(), CFG)
    assert "9 over" in d.message
    d = admit(W(total=10), A(prompt=100, max_tokens=100, ctx=0), Q(), CFG)
    assert "needs 200 KV tokens" in d.message and "40 over" in d.message


def test_clamp_sets_max_tokens():
    d = admit(W(total=1000), A(prompt=8000, max_tokens=500), Q(), AdmissionConfig(clamp_max_tokens=True))
    assert d.max_tokens == 192
    assert admit(W(), A(max_tokens=77), Q(), CFG).max_tokens == 77


def test_retry_after_follows_drain_rate():
    assert retry_after(9, Q(rate=2.0), CFG) == 5  # 10 requests at 2/s
    assert retry_after(0, Q(rate=100.0), CFG) == 1  # never below 1 s
    assert retry_after(10_000, Q(rate=1.0), CFG) == 60  # capped
    assert retry_after(5, Q(rate=0.0), CFG) == CFG.default_retry_after_s  # nothing measured yet
    assert retry_after(5, Q(rate=5e-324), CFG) == 60  # a vanishing rate: capped, not an overflow
    d = admit(W(used=100), A(), Q({0: 10}, 2.0), CFG)
    assert d.retry_after_s == 6 and "retry after 6 s" in d.message
    e = expired(Q({0: 3}, 1.0), CFG)
    assert (e.status, e.retry_after_s) == (429, 4)


def test_reservations_count_against_free_kv():
    # 100 blocks * 16 = 1600 tokens; 1500 reserved by earlier admissions leaves 100 < 200 needed
    assert admit(W(reserved_kv_tokens=1500), A(ctx=0), Q(), CFG).action == "queue"
    half = AdmissionConfig(kv_reserve_fraction=0.5)
    assert kv_tokens_needed(A(prompt=100, max_tokens=100, cached=64), 100, half) == 86


def test_drain_rate_measures_steady_rate_and_decays_over_busy_time_only():
    m = DrainRate(window_s=10)
    assert m.rate(0.0) == 0.0
    m.record(0.1)  # nobody waits: a departure drains no queue
    assert m.rate(0.2) == 0.0
    m.busy(0.0, True)
    t = 0.0
    for _ in range(200):  # 4 per second for 50 s, with requests waiting
        t += 0.25
        m.record(t)
    assert m.rate(t) == pytest.approx(4.0, rel=0.1)
    early = DrainRate(window_s=10)
    early.busy(0.0, True)
    for i in range(1, 9):  # the warm-up is not underestimated: 4/s over the first 2 s
        early.record(i * 0.25)
    assert early.rate(2.0) == pytest.approx(4.0, rel=0.3)
    m.busy(t, False)
    assert m.rate(t + 60) == pytest.approx(4.0, rel=0.1)  # an idle minute: the next burst drains as the last
    m.busy(t + 60, True)
    assert m.rate(t + 90) < 0.3  # requests waiting and none leaving for 30 s: the rate falls away


@settings(max_examples=400, deadline=None)
@given(
    running=st.integers(0, 10), waiting=st.integers(0, 10), slots=st.integers(1, 8),
    total=st.integers(0, 300), used=st.integers(0, 300), healthy=st.booleans(),
    prompt=st.integers(1, 10_000), max_tokens=st.integers(0, 4000), cached=st.integers(0, 10_000),
    priority=st.integers(-2, 2), ctx=st.integers(0, 9000),
    depth=st.dictionaries(st.integers(-2, 2), st.integers(0, 20)), rate=st.floats(0, 50),
)
def test_every_answer_is_well_formed(running, waiting, slots, total, used, healthy, prompt, max_tokens, cached,
                                     priority, ctx, depth, rate):
    target = W(running, waiting, slots, total, min(used, total), healthy=healthy)
    req = A(prompt, max_tokens, min(cached, prompt), priority, ctx)
    d = admit(target, req, Q(depth, rate), CFG)
    assert d.action in ("admit", "queue", "reject")
    if d.action == "reject":
        assert d.status in (400, 429, 503) and d.code and d.message
        assert (d.retry_after_s is not None) == (d.status != 400)
    if d.action == "admit":
        free = target.kv_free_tokens
        assert free is None or kv_tokens_needed(req, d.max_tokens, CFG) <= free
        assert ctx == 0 or prompt + d.max_tokens <= ctx


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 50), st.integers(0, 7), st.integers(0, 400))
def test_the_pooled_queue_never_holds_more_than_every_replicas_queue_max_and_never_less_than_one(queue_max, others,
                                                                                                  waiting):
    """queue_capacity: at least queue_max (a replica is never worse off than alone), at most queue_max x replicas
    (the memory bound), and with the others' queues counted, this replica's capacity plus their waiting stays
    within queue_max x replicas whenever they hold less than that."""
    from policy.admission import queue_capacity

    cfg = AdmissionConfig(queue_max=queue_max)
    cap = queue_capacity(W(other_gateways=others, gateways_waiting=waiting), cfg)
    assert queue_max <= cap <= queue_max * (1 + others)
    if waiting <= queue_max * others:
        assert cap + waiting <= queue_max * (1 + others)
