"""Slot checkpoints against a real llama-server and the bundled model: a prefix whose slot was taken by
another prompt comes back from its file as cached tokens; the index shows it in the checkpoint tier; the
least recently used file goes; and with the default config nothing is written."""
from __future__ import annotations

from pathlib import Path

from cache.hashing import chain_hashes
from cache.memory_index import MemoryPrefixIndex
from cache.publisher import BlockPublisher
from tests.integration.llama_server_helpers import collect, encode, make_backend, request
from tests.waiting import until
from workers.llama_server.checkpoints import checkpoint_name

NO_RAM_CACHE = ["--cache-ram", "0"]
A = encode("The fox and the hound walked along the river bank at dawn. " * 16)
B = encode("To bake bread, mix flour, water, salt and yeast, then knead the dough. " * 12)
C = encode("Chess openings: the Sicilian, the French and the Caro-Kann defences. " * 12)


def files(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()} if d.exists() else set()


async def test_checkpoint_restored_after_its_slot_was_reused_and_lru_deletion(tmp_path):
    index = MemoryPrefixIndex()
    pub = BlockPublisher(index, "t", current_blocks=lambda: backend.cached_blocks())
    ck_dir = tmp_path / "ck"
    # --cache-ram 0: llama-server's own RAM prompt cache would also bring A back (it saves a slot's prompt
    # when a request replaces most of it, by id too): only the checkpoint may here.
    backend = make_backend(tmp_path, sink=pub.sink, slots=1, kv_tokens=2048, extra_args=NO_RAM_CACHE, checkpoints={
        "enabled": True, "dir": str(ck_dir), "min_tokens": 64, "max_files": 2})
    await backend.start()
    await pub.start()
    ck, bs = backend.checkpoints, backend.block_size
    assert min(len(A), len(B), len(C)) > 150
    try:
        first = (await collect(backend, request("a1", A, max_tokens=4)))[-1].usage
        assert first.cached_tokens == 0 and files(ck_dir / "t") == set()
        held_a = backend.lanes[0].slots.slots[0].hashes
        await collect(backend, request("b1", B, max_tokens=4))  # the one slot now holds B: A was saved first
        assert ck.saves == 1 and files(ck_dir / "t") == {checkpoint_name(held_a[-1])}

        again = A + encode(" The end of the story, and the start of another one." * 8)[1:]  # 64+ more tokens
        usage = (await collect(backend, request("a2", again, max_tokens=4)))[-1].usage
        assert ck.restores == 1 and ck.saves == 2  # B saved before A was restored over it
        assert usage.cached_tokens >= len(A) - 1, usage  # llama-server reused the restored prompt
        await pub.flush()
        root = backend.model.chain_root.hash  # checkpoint files are named by chains from the model's root
        a_hashes = chain_hashes(A, bs, root)
        assert await index.longest_prefix(a_hashes, tiers=["checkpoint"]) == {"t": len(a_hashes)}
        b_hashes = chain_hashes(B, bs, root)
        assert await index.longest_prefix(b_hashes, tiers=["checkpoint"]) == {"t": len(b_hashes)}
        assert await index.longest_prefix(b_hashes, tiers=["gpu"]) == {}  # the slot no longer holds B

        # C takes the slot: A's continuation (blocks no file holds) is saved, a third file, so the least
        # recently used one (B's; A's was used by the restore) is deleted.
        await collect(backend, request("c1", C, max_tokens=4))
        assert ck.saves == 3 and ck.store.deleted == 1 and len(files(ck_dir / "t")) == 2
        assert checkpoint_name(chain_hashes(B, bs, root)[-1]) not in files(ck_dir / "t")
        await pub.flush()
        assert await index.longest_prefix(b_hashes, tiers=["checkpoint"]) == {}
        assert await index.longest_prefix(a_hashes, tiers=["checkpoint"]) == {"t": len(a_hashes)}
        # B is gone from disk and slot: served cold, no restore
        usage = (await collect(backend, request("b2", B, max_tokens=2)))[-1].usage
        assert ck.restores == 1 and usage.cached_tokens < 16
    finally:
        await pub.close()
        await backend.close()
    assert files(ck_dir / "t") == set()  # closing deletes them: no later run could find them


async def test_off_by_default_writes_no_files(tmp_path):
    ck_dir = tmp_path / "ck"
    backend = make_backend(tmp_path, slots=1, kv_tokens=1024, extra_args=NO_RAM_CACHE,
                           checkpoints={"dir": str(ck_dir), "min_tokens": 16})
    await backend.start()
    try:
        assert backend.checkpoints is None
        cmdline = Path(f"/proc/{backend.pids()[0]}/cmdline").read_bytes().split(b"\0")
        assert b"--slot-save-path" not in cmdline and b"--swa-full" not in cmdline
        short_a, short_b = A[:80], B[:80]
        await collect(backend, request("a", short_a, max_tokens=2))
        await collect(backend, request("b", short_b, max_tokens=2))
        usage = (await collect(backend, request("a2", short_a, max_tokens=2)))[-1].usage
        assert usage.cached_tokens < 16  # nothing brought A back
        assert not ck_dir.exists()
        assert set(backend.cached_blocks()) == {"gpu"}
    finally:
        await backend.close()



async def test_save_after_request_saves_in_the_background_once(tmp_path):
    ck_dir = tmp_path / "ck"
    backend = make_backend(tmp_path, slots=1, kv_tokens=2048, extra_args=NO_RAM_CACHE, checkpoints={
        "enabled": True, "dir": str(ck_dir), "min_tokens": 64, "save_after_request": True})
    await backend.start()
    ck = backend.checkpoints
    try:
        await collect(backend, request("a1", A, max_tokens=4))
        await until(lambda: ck.saves == 1, timeout_s=30)  # saved after the request, not when B takes the slot
        assert files(ck_dir / "t") == {checkpoint_name(backend.lanes[0].slots.slots[0].hashes[-1])}
        await collect(backend, request("b1", B, max_tokens=4))
        await until(lambda: ck.saves == 2, timeout_s=30)  # B's own; A was not saved a second time
        usage = (await collect(backend, request("a2", A, max_tokens=2)))[-1].usage
        assert ck.restores == 1 and usage.cached_tokens >= len(A) - 1
    finally:
        await backend.close()
