"""A lane: one llama-server process with its slot table, plus the choice of lane by speculation depth K.

llama-server compiles per-request speculation parameters out (`#if 0` upstream), so K is fixed per
process. With a drafter configured, the worker runs two lanes on the device: one with the drafter, one
without, and sends each request to the lane its K asks for (K = 0: the plain lane).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import psutil

from cache.hashing import ROOT_HASH
from policy.profiles import DeviceProfile
from policy.speculation import SCHEMA, TEXT, choose_k
from workers.llama_server import flags
from workers.llama_server.process import LlamaServerProcess
from workers.llama_server.slots import SlotTable

log = logging.getLogger("pulse.llama_server")


class Lane:
    def __init__(self, name: str, argv_for, *, slots: int, block_size: int, log_path: Path, cfg, sink,
                 checkpoints: bool = False, root: int = ROOT_HASH):
        self.name = name
        self.checkpoints = checkpoints  # started with --slot-save-path: its slots can be saved and restored
        self.slots = SlotTable(slots, block_size, sink, root=root)
        self.running = 0
        self.progress_at = float("-inf")  # monotonic time of the last event any stream got: tokens flowing = alive
        self.process = LlamaServerProcess(
            argv_for, name=name, log_path=log_path, startup_timeout_s=cfg.startup_timeout_s,
            backoff_max_s=cfg.restart_backoff_max_s, stop_grace_s=cfg.stop_grace_s, on_exit=self._on_exit)
        self.on_crash = None  # set by the backend: fail this lane's in-flight streams at once

    def _on_exit(self, returncode: int) -> None:
        self.slots.reset()  # its KV is gone: tell the index, and ignore releases from before the crash
        if self.on_crash is not None:
            self.on_crash(self, returncode)

    @property
    def ready(self) -> bool:
        return self.process.ready.is_set()


def cpu_threads(cfg, profile: DeviceProfile, workers_on_box: int, lanes: int) -> int | None:
    """-t: as configured; on a CPU box, the cores split between the workers and lanes sharing it
    (each llama-server would otherwise start one thread per core and they would all contend)."""
    if cfg.threads or profile.kind != "cpu":
        return cfg.threads
    return max(1, (os.cpu_count() or 1) // max(1, workers_on_box * lanes))


PROMPT_CACHE_SHARE = 8  # of the box's memory, for its llama-servers' RAM prompt caches together
LLAMA_CACHE_RAM_MIB = 8192  # llama.cpp's own --cache-ram default


def cache_ram_mib(workers_on_box: int, lanes: int, total_bytes: int | None = None) -> int:
    """--cache-ram for a profile that leaves it unset: an eighth of the box's memory split among the llama-servers
    on it, at most llama.cpp's default. llama-server keeps the state of every prompt whose slot it reuses in that
    RAM cache up to its limit, and the default lets each server take 8 GiB: more than a small box has for the two
    servers of `pulse serve`'s two bundled models (on the 2-core box they grew by 0.1 and 0.6 GiB in 11 minutes of
    distinct prompts, and would have gone on; RELIABILITY.md, the real-backend soak)."""
    total = total_bytes or psutil.virtual_memory().total
    return max(1, min(LLAMA_CACHE_RAM_MIB, (total // PROMPT_CACHE_SHARE // max(1, workers_on_box * lanes)) >> 20))


def build_lanes(cfg, profile: DeviceProfile, model_path: str, binary: Path, block_size: int,
                log_dir: Path, worker_id: str, sink, workers_on_box: int = 1,
                checkpoint_dir: Path | None = None, root: int = ROOT_HASH) -> list[Lane]:
    """The plain lane, and a drafter lane when a drafter is configured (first: the default lane).
    `root`: the model's chain root hash, where its slots' block hashes start.

    Checkpoints (`checkpoint_dir`) go to lanes without a drafter only: a saved slot holds the target
    model's KV, not the drafter's, and restoring it under a drafter is untested."""
    supported = flags.supported_flags(binary)
    slots = cfg.slots or profile.llama_server_slots
    kv_tokens = cfg.kv_tokens or profile.kv_cache_tokens
    k = profile.max_draft_tokens if cfg.draft_max is None else cfg.draft_max
    two = bool(cfg.draft_model) and k > 0 and cfg.plain_process
    threads = cpu_threads(cfg, profile, workers_on_box, 2 if two else 1)
    cache_mib = cache_ram_mib(workers_on_box, 2 if two else 1)

    def argv(draft: bool):
        def argv_for(port: int) -> list[str]:
            return flags.server_argv(
                binary, supported, model=model_path, port=port, slots=slots, kv_tokens=kv_tokens,
                profile_args=profile.llama_server_args if cfg.profile_args is None else cfg.profile_args,
                threads=threads,
                draft_model=cfg.draft_model if draft else None, draft_max=k, spec_type=cfg.spec_type,
                extra_args=cfg.extra_args, slot_save_path=None if draft or not checkpoint_dir else str(checkpoint_dir),
                cache_ram_mib=cache_mib)
        return argv_for

    def lane(name: str, draft: bool) -> Lane:
        return Lane(name, argv(draft), slots=slots, block_size=block_size,
                    log_path=log_dir / f"llama-server-{worker_id}-{name}.log", cfg=cfg, sink=sink,
                    checkpoints=checkpoint_dir is not None and not draft, root=root)

    if not cfg.draft_model or k == 0:
        return [lane("plain", False)]
    if not cfg.plain_process:
        return [lane("spec", True)]
    return [lane("spec", True), lane("plain", False)]


def choose_lane(lanes: list[Lane], profile: DeviceProfile, context_tokens: int, max_draft_tokens: int | None,
                schema: bool = False) -> Lane:
    """The drafter lane when the policy's K (policy.speculation; lowered by max_draft_tokens) is above 0.

    llama-server's K is per process, so the decision is per request, not per step."""
    if len(lanes) == 1:
        return lanes[0]
    spec, plain = lanes
    concurrency = spec.running + plain.running + 1
    k = choose_k(context_tokens, concurrency, SCHEMA if schema else TEXT, profile, max_draft_tokens)
    lane = spec if k > 0 else plain
    # A lane that is restarting should not fail a request the other lane can serve.
    if not lane.ready:
        other = plain if lane is spec else spec
        if other.ready:
            return other
    return lane
