"""Slot checkpoints against a live llama-server: save a slot before its prefix is lost, restore one for a
request whose prefix only a checkpoint holds.

Off unless `workers.llama_server.checkpoints.enabled`. With it, every request's slot choice goes through
`prepare`:
- the longest run of the prompt's leading blocks held by a checkpoint file (checkpoints.CheckpointStore)
  is compared with the best slot's; if the file holds at least `min_tokens` and a block more, it is
  restored (`POST /slots/{id}?action=restore`) into the least recently used idle slot, and the request
  then goes to that slot with `cache_prompt`, so llama-server reuses what was restored;
- before a slot's content is replaced (by that restore, or by a prompt that shares less with it), it is
  saved (`action=save`) when at least `min_tokens` of its full blocks are in no file yet.
With `save_after_request`, a slot is also saved when a request on it ends (in the background).
A failed save or restore never fails the request: it is logged and the request is served from whatever
the slot holds.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp

from cache.hashing import ROOT_HASH, chain_hashes
from workers.llama_server.checkpoints import Checkpoint, CheckpointStore, checkpoint_name
from workers.llama_server.slots import common_prefix

log = logging.getLogger("pulse.llama_server")
_FAILURES = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, OSError, ValueError, KeyError)


class SlotActionError(Exception):
    """llama-server refused a slot action (4xx/5xx with its error message)."""


class Checkpointer:
    def __init__(self, cfg, store: CheckpointStore, block_size: int, timeout_s: float = 30.0,
                 root: int = ROOT_HASH):
        self.cfg, self.store, self.block_size = cfg, store, block_size
        self.root = root  # the model's chain root hash: checkpoint files are named by chains from it
        self.min_blocks = -(-cfg.min_tokens // block_size)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.session: aiohttp.ClientSession | None = None  # the backend's, set when it starts
        self.saves = self.restores = self.failures = 0
        self.save_ms: list[float] = []  # recent durations, for measurement (bounded)
        self.restore_ms: list[float] = []
        self._tasks: set[asyncio.Task] = set()

    async def prepare(self, lane, prompt: list[int]) -> tuple[int | None, list[int]]:
        """The slot to send `prompt` to, reserved (busy), after any restore and save; and the prompt's chain
        hashes (for `SlotTable.acquire`). Slot None: every slot is busy (llama-server will choose)."""
        table, bs = lane.slots, self.block_size
        hashes = chain_hashes(prompt, bs, self.root)
        slot, matched = table.best(prompt)
        if slot is None:
            return None, hashes
        found = self.store.lookup(hashes)
        restore = None
        if found is not None and found[1] * bs >= max(self.cfg.min_tokens, matched + bs):
            restore, slot = found[0], table.least_recent()
        epoch = table.reserve(slot)
        if restore is not None:
            self.store.pin(restore.key)  # the save just below must not delete the file about to be read
        try:
            await self._save_if_lost(lane, slot, list(restore.tokens) if restore else prompt)
            if restore is not None and table.slots[slot].epoch == epoch:
                await self._restore(lane, slot, restore)
        except BaseException:  # cancelled: give the slot back before the request goes away
            table.unreserve(slot, epoch)
            raise
        finally:
            if restore is not None:
                self.store.unpin(restore.key)
        return slot, hashes

    def after_request(self, lane, slot: int) -> None:
        """With `save_after_request`: save slot `slot` now that its request ended (in the background)."""
        s = lane.slots.slots[slot]
        if not self.cfg.save_after_request or s.busy or not self._worth_saving(s.hashes):
            return
        epoch = lane.slots.reserve(slot)
        task = asyncio.create_task(self._save_in_background(lane, slot, epoch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- save ---------------------------------------------------------------------------------------

    def _worth_saving(self, hashes: list[int]) -> bool:
        """At least min_tokens of full blocks that no file holds yet. A session that grows by a short turn
        is not saved again each turn (a multi-MB file for one more block): its older file still holds all
        but those last blocks, and is kept from deletion (touched) as still in use."""
        found = self.store.lookup(hashes)
        covered = 0
        if found is not None:
            self.store.touch(found[0].key)
            covered = found[1]
        return len(hashes) - covered >= self.min_blocks

    async def _save_if_lost(self, lane, slot: int, new_tokens: list[int]) -> None:
        s = lane.slots.slots[slot]
        kept = common_prefix(s.tokens, new_tokens) // self.block_size
        if len(s.hashes) > kept and self._worth_saving(s.hashes):
            await self.save(lane, slot)

    async def _save_in_background(self, lane, slot: int, epoch: int) -> None:
        try:
            await self.save(lane, slot)
        finally:
            lane.slots.unreserve(slot, epoch)

    async def save(self, lane, slot: int) -> bool:
        """Write slot `slot` (idle or reserved) to the file named by its last full block; record it."""
        s = lane.slots.slots[slot]
        hashes, tokens, bs = list(s.hashes), list(s.tokens), self.block_size
        if not hashes:
            return False
        t0 = time.perf_counter()
        try:
            body = await self._action(lane, slot, "save", checkpoint_name(hashes[-1]))
            saved = int(body["n_saved"])
            # llama-server may hold fewer tokens than Pulse thinks (it dropped an idle slot under memory
            # pressure): index only the blocks the file really holds, under the name of the last of them.
            full = min(len(hashes), saved // bs)
            path = self.store.path(hashes[-1])
            if full < self.min_blocks:
                path.unlink(missing_ok=True)
                return False
            if full < len(hashes):
                path = path.rename(self.store.path(hashes[full - 1]))
            self.store.add(hashes[:full], tokens[:saved], path.stat().st_size)
        except _FAILURES + (SlotActionError,) as e:
            self.failures += 1
            log.warning("%s: saving slot %d failed: %s", lane.name, slot, e)
            return False
        self.saves += 1
        _keep(self.save_ms, (time.perf_counter() - t0) * 1000)
        return True

    # -- restore ------------------------------------------------------------------------------------

    async def _restore(self, lane, slot: int, ck: Checkpoint) -> bool:
        table, epoch = lane.slots, lane.slots.slots[slot].epoch
        t0 = time.perf_counter()
        try:
            body = await self._action(lane, slot, "restore", checkpoint_name(ck.key))
            restored = int(body["n_restored"])
        except SlotActionError as e:  # the file is unusable (llama-server emptied the slot): forget it
            self.failures += 1
            log.warning("%s: restoring %s into slot %d failed: %s", lane.name, checkpoint_name(ck.key), slot, e)
            self.store.remove(ck.key)
            if table.slots[slot].epoch == epoch:
                table.load(slot, [], [])
            return False
        except _FAILURES as e:  # what the slot holds now is unknown: claim nothing for it
            self.failures += 1
            log.warning("%s: restoring into slot %d failed: %s", lane.name, slot, e)
            if table.slots[slot].epoch == epoch:
                table.load(slot, [], [])
            return False
        self.store.touch(ck.key)
        if table.slots[slot].epoch == epoch:  # else the process restarted meanwhile: the slot is empty
            table.load(slot, list(ck.tokens[:restored]), ck.hashes[: restored // self.block_size])
        self.restores += 1
        _keep(self.restore_ms, (time.perf_counter() - t0) * 1000)
        return True

    async def _action(self, lane, slot: int, action: str, filename: str) -> dict:
        url = f"{lane.process.url}/slots/{slot}?action={action}"
        async with self.session.post(url, json={"filename": filename}, timeout=self.timeout) as r:
            raw = await r.read()
        if r.status != 200:
            try:
                message = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = raw[:300].decode(errors="replace")
            raise SlotActionError(f"{action} answered {r.status}: {message}")
        return json.loads(raw)


def _keep(samples: list[float], value: float, limit: int = 1024) -> None:
    samples.append(value)
    if len(samples) > limit:
        del samples[: len(samples) - limit]
