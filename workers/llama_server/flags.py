"""llama-server's command line: which flags this binary knows (from its --help), and the argv Pulse runs.

Upstream renames flags now and then (the speculation flags became --spec-draft-*), so every flag Pulse
adds is chosen from its known spellings by what `--help` lists, and a profile flag this binary does not
know is dropped with a warning instead of making the process exit at start.
"""
from __future__ import annotations

import logging
import re
import subprocess
from functools import lru_cache
from pathlib import Path

log = logging.getLogger("pulse.llama_server")

# Spellings of one setting, newest first. A profile may use any of them; the binary gets one it knows.
ALIASES: list[tuple[str, ...]] = [
    ("--spec-draft-model", "--model-draft", "-md"),
    ("--spec-draft-n-max", "--draft-max", "--draft", "--draft-n"),
    ("--spec-draft-n-min", "--draft-min"),
    ("--spec-draft-ngl", "--n-gpu-layers-draft", "-ngld"),
    ("--no-ui", "--no-webui"),
    ("--flash-attn", "-fa"),
    ("--parallel", "-np"),
    ("--ctx-size", "-c"),
    ("--cache-ram", "-cram"),
    ("--kv-unified", "-kvu"),
]
_FLAG = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")
# A token that is a value, not a flag: "-1" and "0.5" are values, "-fa" is a flag.
_IS_FLAG = re.compile(r"^--?[a-zA-Z]")


@lru_cache(maxsize=8)
def _help_flags(binary: str, mtime_ns: int) -> frozenset[str]:
    out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    text = out.stdout + out.stderr
    # --help still lists some removed spellings ("--draft-max ... the argument has been removed"): skip them.
    flags = frozenset(f for line in text.splitlines() if "has been removed" not in line for f in _FLAG.findall(line))
    if "--port" not in flags:
        raise RuntimeError(f"{binary} --help does not look like llama-server's (no --port):\n{text[-800:]}")
    return flags


def supported_flags(binary: Path) -> frozenset[str]:
    """Every flag spelling `binary --help` lists (cached per file version)."""
    return _help_flags(str(binary), binary.stat().st_mtime_ns)


def spelling(flag: str, supported: frozenset[str]) -> str | None:
    """The spelling of `flag`'s setting this binary knows, or None."""
    if flag in supported:
        return flag
    for group in ALIASES:
        if flag in group:
            return next((f for f in group if f in supported), None)
    return None


def group_args(args: list[str]) -> list[tuple[str, list[str]]]:
    """["-fa", "on", "--metrics", "--cache-ram", "-1"] -> [("-fa", ["on"]), ("--metrics", []), ("--cache-ram", ["-1"])]."""
    groups: list[tuple[str, list[str]]] = []
    for a in args:
        if _IS_FLAG.match(a) or not groups:
            groups.append((a, []))
        else:
            groups[-1][1].append(a)
    return groups


def setting(args: list[str], flag: str) -> list[str] | None:
    """The values `args` give `flag`'s setting, in any of its spellings (the last occurrence wins, as in
    llama.cpp's parser); None when they do not set it."""
    group = next((g for g in ALIASES if flag in g), (flag,))
    found = [values for f, values in group_args(args) if f in group]
    return found[-1] if found else None


def sets(args: list[str], flag: str) -> bool:
    """Whether `args` give `flag`'s setting, in any of its spellings."""
    return setting(args, flag) is not None


def adapt(args: list[str], supported: frozenset[str]) -> list[str]:
    """`args` respelled for this binary; flags it does not know at all are dropped (with a warning)."""
    out: list[str] = []
    for flag, values in group_args(args):
        known = spelling(flag, supported)
        if known is None:
            log.warning("llama-server does not support %s; dropping %s", flag, " ".join([flag, *values]))
            continue
        out += [known, *values]
    return out


def server_argv(
    binary: Path,
    supported: frozenset[str],
    *,
    model: str,
    port: int,
    slots: int,
    kv_tokens: int,
    profile_args: list[str],
    threads: int | None = None,
    draft_model: str | None = None,
    draft_max: int | None = None,
    spec_type: str | None = None,
    extra_args: list[str] = (),
    slot_save_path: str | None = None,
    cache_ram_mib: int | None = None,
) -> list[str]:
    """The full llama-server command line. Later flags win in llama.cpp's parser, so extra_args go last.
    `cache_ram_mib`: --cache-ram, where neither the profile's args nor extra_args set it."""
    args = ["-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots), "-c", str(kv_tokens)]
    # One KV pool shared by all slots: a long request may use what idle slots do not (else -c is split
    # evenly and each slot is capped at kv_tokens / slots).
    # ... and idle slots keep their KV: by default llama-server (with --cache-ram) moves every idle slot
    # to its RAM prompt cache and clears it whenever a task starts, so a request sent to the slot that
    # held its prefix would find it empty. llama-server still clears idle slots when the pool runs out.
    args += ["--kv-unified", "--no-cache-idle-slots"]
    args += ["--slots", "--no-ui"]
    if threads:
        args += ["-t", str(threads)]
    if cache_ram_mib is not None and not sets(list(profile_args) + list(extra_args), "--cache-ram"):
        args += ["--cache-ram", str(cache_ram_mib)]
    args += profile_args
    if slot_save_path:
        # Slot checkpoints. --swa-full: with a sliding-window model (Gemma 3) a restored slot otherwise
        # holds too little of the window for llama-server to trust it, and it re-prefills the whole
        # prompt (measured: cache_n 0 after a restore without it, 1082 of 1082 with it). It keeps
        # full-size KV for the window layers; a model without sliding-window layers ignores it.
        args += ["--slot-save-path", slot_save_path, "--swa-full"]
    if draft_model:
        args += ["--spec-draft-model", draft_model]
        if draft_max is not None:
            args += ["--spec-draft-n-max", str(draft_max)]
        if spec_type:
            args += ["--spec-type", spec_type]
    return [str(binary), *adapt(args, supported), *extra_args]
