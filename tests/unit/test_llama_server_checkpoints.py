"""Slot checkpoint bookkeeping: file names, lookup, least-recently-used deletion, index events (no process)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from cache.hashing import chain_hashes
from workers.llama_server.checkpoints import CheckpointStore, checkpoint_name
from workers.llama_server.flags import server_argv
from workers.llama_server.slots import SlotTable

BS = 16
A = list(range(100, 164))  # 4 blocks
B = list(range(500, 564))  # 4 blocks, shares nothing with A


def store(tmp_path: Path, max_files=8, max_bytes=10**9):
    events = []
    s = CheckpointStore(tmp_path, max_files=max_files, max_bytes=max_bytes, sink=events.append)
    s.clear_dir()
    return s, events


def save(s: CheckpointStore, tokens: list[int], size: int = 100):
    """What the checkpointer does after llama-server wrote the file: a real file, then the record."""
    hashes = chain_hashes(tokens, BS)
    s.path(hashes[-1]).write_bytes(b"x" * size)
    return s.add(hashes, tokens, size)


def published(events, tier="checkpoint") -> set[int]:
    live: set[int] = set()
    for e in events:
        assert e.tier == tier
        live = live | set(e.hashes) if e.kind == "added" else live - set(e.hashes)
    return live


def test_names_are_the_prefix_hash_in_hex_and_safe_for_llama_server():
    h = chain_hashes(A, BS)[-1]
    name = checkpoint_name(h)
    assert re.fullmatch(r"[0-9a-f]{16}\.slot", name) and int(name[:16], 16) == h
    assert checkpoint_name(chain_hashes(A[:48], BS)[-1]) != name  # a shorter prefix is another file
    assert checkpoint_name(1) == "0000000000000001.slot"


def test_add_publishes_each_block_once_and_lookup_finds_the_longest_prefix(tmp_path):
    s, events = store(tmp_path)
    save(s, A[:32])
    save(s, A)  # shares its first 2 blocks with the first file
    assert published(events) == set(chain_hashes(A, BS))
    assert sum(len(e.hashes) for e in events) == 4  # shared blocks not published twice
    ck, n = s.lookup(chain_hashes(A + [1] * 20, BS))
    assert n == 4 and list(ck.tokens) == A
    ck, n = s.lookup(chain_hashes(A[:40] + [7] * 30, BS))  # diverges inside block 3
    assert n == 2 and list(ck.tokens) == A[:32]  # ties: the smaller file (less to restore)
    assert s.lookup(chain_hashes(B, BS)) is None
    assert s.lookup([]) is None
    assert s.covers(chain_hashes(A, BS)[2]) and not s.covers(chain_hashes(B, BS)[0])


def test_least_recently_used_file_is_deleted_with_its_index_entries(tmp_path):
    s, events = store(tmp_path, max_files=2)
    a, b = save(s, A), save(s, B)
    s.touch(a.key)  # A restored: B is now the least recently used
    c = save(s, A[:16] + [9] * 32)  # shares A's first block
    assert s.keys() == [a.key, c.key] and s.deleted == 1
    assert not s.path(b.key).exists() and s.path(a.key).exists() and s.path(c.key).exists()
    assert published(events) == set(chain_hashes(A, BS)) | set(chain_hashes(A[:16] + [9] * 32, BS))
    s.remove(a.key)
    assert published(events) == set(chain_hashes(A[:16] + [9] * 32, BS))  # the shared block stays
    assert s.bytes == 100


def test_size_limit_and_pinned_files(tmp_path):
    s, _ = store(tmp_path, max_bytes=250)
    a = save(s, A)
    s.pin(a.key)  # being restored: not deleted under it
    save(s, B)
    save(s, A[:16] + B[:16])
    assert a.key in s and len(s) == 2 and s.bytes == 200  # B went instead
    s.unpin(a.key)
    assert len(s) == 2
    big = save(s, B[:32], size=300)  # larger than the limit alone: nothing can keep it
    assert big.key not in s and s.bytes <= 250


def test_same_prefix_saved_again_replaces_its_record(tmp_path):
    s, events = store(tmp_path)
    save(s, A, size=100)
    save(s, A + [5, 6, 7], size=120)  # the same full blocks, more tokens after them
    assert len(s) == 1 and s.bytes == 120 and len(s.lookup(chain_hashes(A, BS))[0].tokens) == 67
    assert [e.kind for e in events] == ["added"]  # nothing evicted and re-added


def test_clear_dir_deletes_only_checkpoint_files(tmp_path):
    (tmp_path / "0000000000000001.slot").write_bytes(b"old")
    (tmp_path / "notes.txt").write_text("keep")
    s, _ = store(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"] and len(s) == 0
    save(s, A)
    s.remove_all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"] and s.bytes == 0


def test_slot_table_reserve_best_and_load():
    events = []
    t = SlotTable(2, BS, events.append)
    t.release(0, t.acquire(0, A), [])
    assert t.best(A + [1]) == (0, 64) and t.best(B) == (1, 0)  # a miss: the empty slot, nothing matched
    epoch = t.reserve(1)
    assert t.best(B) == (0, 0) and t.least_recent() == 0  # reserved slots are not offered
    t.load(1, B, chain_hashes(B, BS))  # a restore: the index learns the slot holds B
    assert set(chain_hashes(B, BS)) <= {h for e in events if e.kind == "added" for h in e.hashes}
    t.unreserve(1, epoch)
    assert t.best(B + [3]) == (1, 64)
    e2 = t.reserve(0)
    t.reset()  # the process died meanwhile: a stale unreserve must not free the new epoch's slot
    t.acquire(0, A)
    t.unreserve(0, e2)
    assert t.slots[0].busy


@pytest.mark.parametrize("path", [None, "/tmp/ck"])
def test_argv_has_slot_save_path_and_swa_full_only_with_checkpoints(path):
    supported = frozenset({"-m", "--host", "--port", "-np", "-c", "--kv-unified", "--slots", "--no-ui",
                           "--slot-save-path", "--swa-full"})
    argv = server_argv(Path("/bin/ls"), supported, model="/m.gguf", port=1, slots=1, kv_tokens=64,
                       profile_args=[], slot_save_path=path)
    line = " ".join(argv)
    assert ("--slot-save-path /tmp/ck --swa-full" in line) == (path is not None)
    assert ("--slot-save-path" in line) == (path is not None)


def test_worth_saving_counts_only_blocks_no_file_holds(tmp_path):
    from policy.config import LlamaCheckpointConfig
    from workers.llama_server.checkpointer import Checkpointer

    s, _ = store(tmp_path)
    ck = Checkpointer(LlamaCheckpointConfig(enabled=True, min_tokens=32), s, BS)  # 2 blocks
    a, b = save(s, A), save(s, B)
    assert s.keys() == [a.key, b.key]
    assert not ck._worth_saving(chain_hashes(A + [1] * 16, BS))  # one block beyond A's file: not worth it
    assert s.keys() == [b.key, a.key]  # ... and A's file counts as used
    assert ck._worth_saving(chain_hashes(A + [1] * 32, BS))
    assert not ck._worth_saving(chain_hashes([7] * 16, BS))  # one block in all
    assert ck._worth_saving(chain_hashes([7] * 32, BS))
