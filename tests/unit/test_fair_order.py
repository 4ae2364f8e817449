"""policy.admission: a request's priority comes from its key, and queued requests are served in FairOrder.

Tables of cases: each is a script of arrivals ("A" = one request of tenant A at the priority its key
allows) and serves (one slot frees: the first queued in FairOrder goes), and the order requests are served.
"""
from __future__ import annotations

import heapq
import itertools

import pytest

from policy.admission import FairOrder, effective_priority


@pytest.mark.parametrize("asked, key_max, expected", [
    (None, 0, 0),     # no ask: the key's own
    (None, 5, 5),
    (10, 0, 0),       # asking above the key is clamped, not obeyed
    (10, 5, 5),
    (3, 5, 3),        # asking for less is honoured
    (-1, 5, -1),      # down to background
    (-3, -1, -3),
    (0, -1, -1),      # a background key cannot ask its way up
])
def test_effective_priority(asked, key_max, expected):
    assert effective_priority(asked, key_max) == expected


def run(script: str, priorities: dict[str, int] | None = None) -> str:
    """Play `script`: a letter queues one request of that tenant, "." serves the first queued, "x<T>"
    withdraws tenant T's last queued request. Returns the served tenants in order (the queue is drained at the end)."""
    fair, heap, seq, served = FairOrder(), [], itertools.count(), []
    priorities = priorities or {}
    tokens = iter(script.replace(" ", ""))
    for ch in tokens:
        if ch == ".":
            if heap:
                key = heapq.heappop(heap)
                fair.served(key[:2])
                served.append(key[3])
        elif ch == "x":
            tenant = next(tokens)
            entry = max(e for e in heap if e[3] == tenant)
            heap.remove(entry)
            heapq.heapify(heap)
            fair.withdrawn(entry[:2], tenant)
        else:
            heapq.heappush(heap, (*fair.tag(priorities.get(ch, 0), ch), next(seq), ch))
    while heap:
        key = heapq.heappop(heap)
        fair.served(key[:2])
        served.append(key[3])
    return "".join(served)


@pytest.mark.parametrize("script, priorities, expected", [
    ("AAAAA", None, "AAAAA"),                                # one tenant: first come, first served
    ("AAAAAA BB", None, "ABABAAAA"),                         # a flood does not starve a later tenant
    ("AAAAAA BB CC", None, "ABCABCAAAA"),                    # three tenants share turns
    ("AAA .. B", None, "AABA"),                              # served turns are not charged twice
    ("AAAAAAAA .... BB", None, "AAAABABAAA"),                 # B starts at the current virtual time, not at 0
    ("LLLLL H", {"L": 0, "H": 5}, "HLLLLL"),                 # a higher-priority key goes first
    ("HHH LLL", {"L": -1, "H": 0}, "HHHLLL"),                # a background key never outranks
    ("AAAAA BBBBB", {"A": 1, "B": 1}, "ABABABABAB"),        # fairness within a priority level
    ("AAA xA xA BBB A", None, "ABBAB"),                     # tags of withdrawn requests are given back
])
def test_fair_order(script, priorities, expected):
    assert run(script, priorities) == expected


def test_a_flood_delays_another_tenant_by_at_most_one_turn():
    """However many requests one tenant queues, a request of another waits behind at most one of them."""
    for flood in (1, 10, 1000):
        order = run("A" * flood + " B")
        assert order.index("B") <= 1
