"""Slot choice for prefix affinity and the block events it publishes (pure, no process)."""
from __future__ import annotations

from cache.hashing import chain_hashes
from workers.llama_server.slots import SlotTable, common_prefix

A = list(range(100, 164))  # 4 blocks of 16
B = list(range(500, 548))  # 3 blocks


def table(n=2):
    events = []
    return SlotTable(n, 16, events.append), events


def test_common_prefix():
    assert common_prefix(A, A) == 64
    assert common_prefix(A, A[:10] + [0]) == 10
    assert common_prefix(list(range(1000)), list(range(999)) + [5]) == 999
    assert common_prefix([], A) == 0


def test_longest_shared_prefix_else_least_recently_used():
    t, _ = table(3)
    assert t.choose(A) == 0
    t.release(0, t.acquire(0, A), [7, 8])
    assert t.choose(B) == 1  # no shared block: an empty slot, not slot 0's cache
    t.release(1, t.acquire(1, B), [9])
    assert t.choose(A + [1, 2]) == 0 and t.choose(B[:20]) == 1
    assert t.choose(A[:10]) == 2  # shares less than a block with slot 0: not a hit
    t.release(2, t.acquire(2, A[:32]), [])
    assert t.choose(A) == 0  # the longest prefix wins
    assert t.choose(list(range(7000, 7100))) == 0  # a miss evicts the least recently used


def test_busy_slots_are_not_chosen():
    t, _ = table(2)
    t.release(0, t.acquire(0, A), [])
    t.release(1, t.acquire(1, A[:16]), [])
    t.acquire(0, A)
    assert t.choose(A) == 1
    t.acquire(1, B)
    assert t.choose(A) is None  # all busy: llama-server queues it


def test_block_events_added_extended_and_evicted():
    t, events = table(1)
    e = t.acquire(0, A)
    assert events == [events[0]] and events[0].kind == "added" and events[0].hashes == chain_hashes(A, 16)
    gen = list(range(900, 920))  # 20 generated: 19 were evaluated -> one more full block (64 + 19 = 83)
    t.release(0, e, gen)
    assert events[-1].kind == "added" and events[-1].hashes == chain_hashes(A + gen, 16)[4:5]
    events.clear()
    t.release(0, t.acquire(0, A[:32] + B), [])
    kinds = {ev.kind: ev.hashes for ev in events}
    assert kinds["evicted"] == chain_hashes(A + gen, 16)[2:]
    assert kinds["added"] == chain_hashes(A[:32] + B, 16)[2:]


def test_shared_blocks_stay_until_no_slot_holds_them():
    t, events = table(2)
    t.release(0, t.acquire(0, A), [])
    t.release(1, t.acquire(1, A), [])
    assert [ev.kind for ev in events] == ["added"]  # the second slot adds nothing new to the index
    t.acquire(0, B)
    assert all(ev.kind == "added" for ev in events)  # slot 1 still holds A
    t.acquire(1, B)
    assert events[-1].kind == "evicted" and events[-1].hashes == chain_hashes(A, 16)


def test_reset_evicts_everything_and_ignores_stale_releases():
    t, events = table(2)
    e = t.acquire(0, A)
    t.reset()
    assert events[-1].kind == "evicted" and set(events[-1].hashes) == set(chain_hashes(A, 16))
    t.release(0, e, [1, 2, 3])
    assert t.slots[0].tokens == [] and t.used_blocks() == 0


def test_failed_request_forgets_the_slot():
    t, events = table(1)
    t.release(0, t.acquire(0, A), [], failed=True)
    assert t.slots[0].tokens == [] and events[-1].kind == "evicted" and not t.slots[0].busy


def test_slot_hashes_start_from_the_models_chain_root():
    events = []
    t = SlotTable(1, 16, events.append, root=12345)
    t.release(0, t.acquire(0, A), list(range(900, 918)))  # 17 generated tokens: one more full block
    want = chain_hashes(A + list(range(900, 917)), 16, 12345)
    assert t.slots[0].hashes == want and not set(want) & set(chain_hashes(A, 16))
    assert [h for e in events if e.kind == "added" for h in e.hashes] == want


def test_no_slot_is_chosen_while_a_request_sent_without_one_is_unplaced():
    """llama-server gives a queued request whichever slot frees first, and Pulse learns which only from its first
    event: any slot counted idle meanwhile may be that one's, and a request sent to it would wait for its end."""
    t, _ = table(2)
    on_0 = t.acquire(0, A)
    t.acquire(1, B)
    assert t.choose(A) is None
    t.sent_unplaced()  # so it went with no slot
    t.release(0, on_0, [])  # the request on slot 0 ended: llama-server may have launched the queued one there
    assert not t.slots[0].busy and t.choose(A) is None
    t.placed()  # its first event named the slot
    assert t.choose(A) == 0


def test_a_slot_counts_its_holders_and_keeps_the_latest_prompt():
    """llama-server may start a request on a slot before Pulse reads the end of the one before it there: the
    earlier release neither frees the slot nor overwrites what the later request put in it."""
    t, _ = table(1)
    first = t.acquire(0, A)
    second = t.acquire(0, B)  # placed by llama-server, learned from its first event
    t.release(0, first, [1, 2, 3])
    assert t.slots[0].busy and t.slots[0].tokens == B and t.choose(A) is None
    t.release(0, second, [4, 5])
    assert not t.slots[0].busy and t.slots[0].tokens == B + [4]


def test_a_reservation_becomes_the_requests_hold():
    t, _ = table(1)
    epoch = t.reserve(0)
    assert t.choose(A) is None
    ticket = t.acquire(0, A)
    t.unreserve(0, epoch)  # a late unreserve (e.g. a cancelled restore) does not free a held slot
    assert t.slots[0].busy
    t.release(0, ticket, [])
    assert not t.slots[0].busy


async def test_a_request_with_no_slot_waits_for_named_ones_sent_before_it_to_start():
    """Over separate connections it could reach llama-server first and take the slot the named one was sent to."""
    import asyncio
    import time

    t, _ = table(2)
    t0 = time.monotonic()
    await t.named_ahead()  # nothing named in flight: no wait
    assert time.monotonic() - t0 < 0.05
    t.sent_named()
    t.sent_named()
    waiter = asyncio.create_task(t.named_ahead(hold_s=5))
    await asyncio.sleep(0.02)
    t.started()
    await asyncio.sleep(0.02)
    assert not waiter.done()  # one named request has not started yet
    t.started()
    await asyncio.wait_for(waiter, 1)
    t.sent_named()
    t0 = time.monotonic()
    await t.named_ahead(hold_s=0.05)  # never started (a long prefill): held no longer than hold_s
    assert 0.04 < time.monotonic() - t0 < 1


async def test_a_request_sent_beyond_the_slots_waits_for_those_sent_to_free_ones_to_be_placed():
    """When the gateway hands over more requests than free slots, the ones sent while a slot was free must reach
    llama-server first: one sent beyond the slots would otherwise take a free slot and leave an older request to
    llama-server's deferred list for a whole generation. Those sent to free slots themselves do not wait."""
    import asyncio
    import time

    t, _ = table(2)
    t.sent_unplaced()  # a slot was free
    t.sent_unplaced()
    t0 = time.monotonic()
    await t.named_ahead(hold_s=5)  # sent to a free slot too: it does not wait for the others
    assert time.monotonic() - t0 < 0.05
    t.sent_unplaced(beyond=True)
    waiter = asyncio.create_task(t.named_ahead(hold_s=5, beyond=True))
    await asyncio.sleep(0.02)
    t.placed()
    await asyncio.sleep(0.02)
    assert not waiter.done()  # one sent to a free slot is not placed yet
    t.placed(beyond=True)  # another one beyond the slots being placed changes nothing
    await asyncio.sleep(0.02)
    assert not waiter.done() and t.launching == 1
    t.placed()
    await asyncio.wait_for(waiter, 1)
    assert t.launching == 0 and t.unplaced == 0
    t.sent_unplaced()
    t0 = time.monotonic()
    await t.named_ahead(hold_s=0.05, beyond=True)  # never placed (deferred after all): held no longer than hold_s
    assert 0.04 < time.monotonic() - t0 < 1
    t.placed()
    t.sent_named()  # a named one ahead holds it too, as before
    waiter = asyncio.create_task(t.named_ahead(hold_s=5, beyond=True))
    await asyncio.sleep(0.02)
    assert not waiter.done()
    t.started()
    await asyncio.wait_for(waiter, 1)
