"""Which slot checkpoints exist on disk: file names, least-recently-used deletion, prefix-index events.

A checkpoint is one llama-server slot saved with `POST /slots/{id}?action=save`: the tokens it held and
their KV. Its file is named by the chain hash of its last full block (cache.hashing), which names the
whole prefix, so the router's hashes, the index's entries and the files all agree. The store publishes
the blocks of every file in the index's `checkpoint` tier (a block several files share stays published
until none holds it) and deletes the least recently used files past `max_files` / `max_bytes`.

Pure bookkeeping plus `os.unlink`: the HTTP calls that write and read the files are checkpointer.py's.
"""
from __future__ import annotations

import logging
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

from workers.protocol import BlockEvent, BlockSink

log = logging.getLogger("pulse.llama_server")
TIER = "checkpoint"
_SUFFIX = ".slot"


def checkpoint_name(prefix_hash: int) -> str:
    """The file name for the prefix ending in the block whose chain hash is `prefix_hash`.

    Hex digits and a dot only: llama-server accepts bare file names inside its --slot-save-path."""
    return f"{prefix_hash:016x}{_SUFFIX}"


@dataclass
class Checkpoint:
    key: int  # chain hash of the last full block
    hashes: list[int]  # chain hashes of every full block it holds
    tokens: array  # what the slot held (int32, compact: a 128k-token prompt is 512 KB, not 4.5 MB of ints)
    size: int  # bytes on disk
    pins: int = 0  # restores reading it now: not deleted until they finish


class CheckpointStore:
    def __init__(self, directory: Path, *, max_files: int, max_bytes: int, sink: BlockSink | None = None):
        self.dir, self.max_files, self.max_bytes, self.sink = Path(directory), max_files, max_bytes, sink
        self._items: OrderedDict[int, Checkpoint] = OrderedDict()  # least recently used first
        self._refs: Counter[int] = Counter()  # block hash -> files holding it
        self.bytes = 0
        self.deleted = 0  # files deleted for space (for stats and tests)

    def clear_dir(self) -> None:
        """Create the folder and delete checkpoint files a previous run left: nothing records which blocks
        they hold (and the model may have changed), so they could never be found again."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for f in self.dir.glob(f"*{_SUFFIX}"):
            f.unlink(missing_ok=True)

    def path(self, key: int) -> Path:
        return self.dir / checkpoint_name(key)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: int) -> bool:
        return key in self._items

    def covers(self, block: int) -> bool:
        """Whether some file holds `block`, and so (chain hashes) the whole prefix up to it."""
        return block in self._refs

    def blocks(self) -> list[int]:
        return list(self._refs)

    def keys(self) -> list[int]:
        """Least recently used first."""
        return list(self._items)

    def add(self, hashes: list[int], tokens: list[int], size: int) -> Checkpoint:
        """Record the file just written for `hashes` (its name: `checkpoint_name(hashes[-1])`), publish its
        blocks, then delete least recently used files past the limits."""
        key = hashes[-1]
        item = Checkpoint(key, list(hashes), array("i", tokens), size)
        added = [h for h in hashes if h not in self._refs]
        self._refs.update(hashes)
        old = self._items.pop(key, None)
        self._items[key] = item
        self.bytes += size
        self._emit("added", added)
        if old is not None:  # the same prefix saved again (the file was overwritten): drop the old record
            self.bytes -= old.size
            self._release(old.hashes)
        self._enforce()
        return item

    def lookup(self, prompt_hashes: list[int]) -> tuple[Checkpoint, int] | None:
        """The checkpoint sharing the most leading blocks with a prompt (ties: the smallest file), and how
        many blocks it shares; None if none shares one."""
        # A file holding block i holds every block before it (chain hashes), so "some file holds the
        # prompt's block i" is true up to some i and false after: binary search for that i.
        lo, hi = 0, len(prompt_hashes)
        while lo < hi:
            mid = (lo + hi) // 2
            if prompt_hashes[mid] in self._refs:
                lo = mid + 1
            else:
                hi = mid
        if lo == 0:
            return None
        last = prompt_hashes[lo - 1]
        best = min((c for c in self._items.values() if len(c.hashes) >= lo and c.hashes[lo - 1] == last),
                   key=lambda c: len(c.tokens))
        return best, lo

    def touch(self, key: int) -> None:
        """A restore used it: it becomes the most recently used."""
        if key in self._items:
            self._items.move_to_end(key)

    def pin(self, key: int) -> None:
        self._items[key].pins += 1

    def unpin(self, key: int) -> None:
        item = self._items.get(key)
        if item is not None:
            item.pins -= 1
        self._enforce()

    def remove(self, key: int) -> None:
        """Delete one file and its index entries (a restore found it unreadable, say)."""
        item = self._items.pop(key, None)
        if item is not None:
            self._delete(item)

    def remove_all(self) -> None:
        for key in list(self._items):
            self.remove(key)

    def _enforce(self) -> None:
        while len(self._items) > self.max_files or self.bytes > self.max_bytes:
            victim = next((c for c in self._items.values() if c.pins == 0), None)
            if victim is None:
                return  # every file is being restored: delete when the restores finish (unpin)
            del self._items[victim.key]
            self._delete(victim)
            self.deleted += 1

    def _delete(self, item: Checkpoint) -> None:
        self.bytes -= item.size
        try:
            self.path(item.key).unlink(missing_ok=True)
        except OSError as e:  # the index must still forget it: a file nobody finds is only wasted disk
            log.warning("could not delete checkpoint %s: %s", self.path(item.key), e)
        self._release(item.hashes)

    def _release(self, hashes: list[int]) -> None:
        gone = []
        for h in hashes:
            self._refs[h] -= 1
            if self._refs[h] <= 0:
                del self._refs[h]
                gone.append(h)
        self._emit("evicted", gone)

    def _emit(self, kind: str, hashes: list[int]) -> None:
        if hashes and self.sink is not None:
            self.sink(BlockEvent(kind=kind, hashes=hashes, tier=TIER))
