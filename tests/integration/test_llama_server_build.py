"""deploy/build_llama_server.sh's choice among cached builds: a build that dies with SIGILL on this CPU is
passed over for the safer instruction set, which is checked (--version and one generated token with the real
binary and the bundled model) and installed; a rerun on the same CPU does nothing. No compiling here: the
variants are put in a scratch cache (the real binary as the safe one)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.integration.llama_server_helpers import llama_server_binary
from workers.llama_server.binary import BUILD_SCRIPT, cached_binary, pinned_version
from workers.protocol.model import load_model_info

SIGILL_BINARY = "#!/bin/sh\nkill -ILL $$\n"  # what a -march=native build does on a CPU lacking an instruction


def _arch_sets() -> tuple[str, str]:
    out = subprocess.run(["bash", "-c", f"source {BUILD_SCRIPT.parent / 'llama_isa.sh'}; isa_sets"],
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0], out[-1]


def _run(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PULSE_CACHE_DIR": str(cache), "PULSE_LLAMA_CHECK_MODEL": load_model_info().path}
    return subprocess.run(["bash", str(BUILD_SCRIPT), *args], capture_output=True, text=True, env=env, timeout=600,
                          check=False)


def _variant(cache: Path, isa: str) -> Path:
    """Where the build script keeps (or would build) `isa`'s binary: per flavour, set and llama_patches/ set."""
    run = _run(cache, "--print-variant", isa)
    assert run.returncode == 0, run.stderr
    return Path(run.stdout.strip())


def test_a_crashing_build_falls_back_to_the_safer_set_and_is_cached(tmp_path, monkeypatch):
    real = llama_server_binary()
    preferred, safe = _arch_sets()
    crashing, safe_variant = _variant(tmp_path, preferred), _variant(tmp_path, safe)
    assert crashing.is_relative_to(tmp_path / "llama.cpp" / pinned_version() / "variants")
    crashing.parent.mkdir(parents=True)
    crashing.write_text(SIGILL_BINARY)
    crashing.chmod(0o755)
    safe_variant.parent.mkdir(parents=True)
    shutil.copy2(real, safe_variant)

    first = _run(tmp_path)
    out = first.stdout + first.stderr
    assert first.returncode == 0, out[-3000:]
    assert f"cpu, {preferred}) crashed on this CPU" in out and "killed by SIGILL" in out
    assert "one-token generation ok" in out
    installed = tmp_path / "llama.cpp" / pinned_version() / "bin" / "llama-server"
    assert installed.read_bytes() == real.read_bytes()
    stamp = (installed.parents[1] / "installed").read_text().split()
    assert stamp[:2] == ["cpu", safe] and safe_variant.parent.name == f"cpu-{safe}-{stamp[3]}"

    again = _run(tmp_path)
    assert again.returncode == 0 and "already built and checked on this CPU" in again.stdout, again.stderr[-2000:]
    # --print-path names where Pulse looks for the binary
    printed = _run(tmp_path, "--print-path").stdout.strip()
    assert printed == str(installed)
    monkeypatch.setenv("PULSE_CACHE_DIR", str(tmp_path))
    assert cached_binary() == installed


def test_only_the_crashing_set_fails_loudly(tmp_path):
    preferred, _ = _arch_sets()
    variant = _variant(tmp_path, preferred)
    variant.parent.mkdir(parents=True)
    variant.write_text(SIGILL_BINARY)
    variant.chmod(0o755)
    run = _run(tmp_path, "--isa", preferred)
    assert run.returncode == 1 and "gave a llama-server that runs here" in run.stderr, run.stderr[-2000:]
    assert not (tmp_path / "llama.cpp" / pinned_version() / "bin" / "llama-server").exists()
    assert _run(tmp_path, "--isa", "pentium").returncode == 2
