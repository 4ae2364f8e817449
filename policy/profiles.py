"""Device profiles: the measured tables for one device + model, as data (policy/profiles/*.yaml).

A profile says how much KV to allocate, how many sequences to run at once, which speculation depth K
wins by context length and live concurrency, and which llama-server flags suit the box. Selection is a
pure function of the device's name; the YAML files are package data read once.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Literal
from importlib import resources

import yaml
from pydantic import Field

from policy.config import PulseModel


class SpeculationRule(PulseModel):
    """K for requests whose context length is below `max_context` while concurrency is at most `max_concurrency`."""

    max_context: int = Field(description="Rule applies below this many context tokens.")
    max_concurrency: int = Field(1_000_000, description="Rule applies at or below this many live sequences.")
    k: int = Field(ge=0, description="Draft tokens per step; 0 disables speculation.")
    workload: str | None = Field(None, description="Only for this workload class (e.g. 'schema'); empty: any.")


class DeviceProfile(PulseModel):
    name: str = Field(description="Profile name, e.g. 'gb10', 'thor', 'cuda', 'cpu'.")
    description: str = Field("", description="What box and model the figures come from.")
    match: list[str] = Field(default_factory=list, description="Substrings of the device name that select it.")
    kind: str = Field("cuda", description="'cuda' or 'cpu'.")
    default_backend: Literal["cupy", "llama-server"] = Field(
        "cupy", description="What a worker runs when the config names no backend: the one measured fastest here."
    )
    context_length: int = Field(8192, ge=16, description="Largest context served by default.")
    max_num_seqs: int = Field(16, ge=1, description="Sequences running at once in the engine.")
    kv_cache_tokens: int = Field(65536, ge=16, description="KV cache size in tokens (per worker).")
    max_draft_tokens: int = Field(4, ge=0, description="Upper bound on K on this device.")
    speculation: list[SpeculationRule] = Field(default_factory=list, description="K table, first match wins.")
    draft_token_cost: float = Field(0.05, ge=0, description=(
        "Cost of one more token in a step, as a fraction of a batch-1 decode step: what a draft token costs "
        "when speculation weighs it against its expected acceptance (policy.speculation.choose_depth)."))
    speculation_gate: bool = Field(True, description=(
        "Time decode steps with prompt-lookup drafting on and off per concurrency and keep the faster "
        "(policy.speculation.SpeculationGate); false: draft wherever the table and acceptance say."))
    prefill_wait_steps: int = Field(0, ge=0, description=(
        "Prefill coalescing: a request arriving while others decode waits up to this many engine steps so that "
        "arrivals share one eager prefill step and the rest stay on CUDA graphs (workers/cupy/scheduler.py); "
        "0: admit at once."))
    worker_queue: int | None = Field(None, ge=0, description=(
        "Requests beyond max_num_seqs the engine takes into its own queue (the gateway sends them unless "
        "admission.worker_queue_max is set), so a finished sequence's place is refilled at the next step rather "
        "than after the gateway hears of the end; empty: the gateway's default (4)."))
    llama_server_args: list[str] = Field(default_factory=list, description="llama-server flags for this box.")
    llama_server_slots: int = Field(4, ge=1, description="llama-server -np.")
    source: str = Field("", description="Where the figures come from (command, document).")


@lru_cache(maxsize=1)
def builtin_profiles() -> dict[str, DeviceProfile]:
    out: dict[str, DeviceProfile] = {}
    for entry in resources.files("policy").joinpath("profiles").iterdir():
        if entry.name.endswith(".yaml"):
            p = DeviceProfile.model_validate(yaml.safe_load(entry.read_text()))
            out[p.name] = p
    return out


def select_profile(device_name: str, profiles: dict[str, DeviceProfile], requested: str | None = None) -> DeviceProfile:
    """The named profile, else the first whose `match` substring is in the device name, else generic."""
    if requested:
        if requested not in profiles:
            raise KeyError(f"unknown device profile {requested!r}; known: {sorted(profiles)}")
        return profiles[requested]
    lowered = device_name.lower()
    for p in profiles.values():
        if any(m.lower() in lowered for m in p.match):
            return p
    return profiles["cpu" if lowered in ("", "cpu") else "cuda"]
