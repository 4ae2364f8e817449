"""workers/protocol/model.py's derive_apart: `pulse serve`'s driver has the model's cached files made in a child
process, so that it never holds the GGUF converter (transformers) or a tokenizer for the whole serve."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from workers.protocol import model
from workers.protocol.model import SMOLLM2_BUNDLED, bundled_model_path, derive_apart, model_cache_dir


def test_the_files_are_derived_in_a_child_process(tmp_path, monkeypatch):
    monkeypatch.setenv(model.CACHE_ENV, str(tmp_path))  # an empty cache, which the child inherits
    path = bundled_model_path(SMOLLM2_BUNDLED)

    def here(*_):
        raise AssertionError("derived in this process")

    monkeypatch.setattr(model, "_derive", here)
    derive_apart(str(path))
    out = model_cache_dir(path)
    assert (out / "info.json").exists() and (out / "tokenizer.json").exists()
    assert model.load_model_info.__wrapped__(str(path)).vocab_size == 49152
    derive_apart(str(path))  # already there: nothing to do (no child, no _derive)


def test_a_file_that_is_not_a_gguf_is_a_value_error_with_the_readers_reason(tmp_path, monkeypatch):
    monkeypatch.setenv(model.CACHE_ENV, str(tmp_path / "cache"))
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"these are not the weights you are looking for\n" * 100)
    with pytest.raises(ValueError, match="cannot read the model file: .*GGUF magic invalid"):
        derive_apart(str(bad))


def test_pulse_serve_refuses_such_a_file_before_starting_anything(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"\0" * 4096)
    done = subprocess.run([sys.executable, "-m", "pulse.cli", "serve", "--backend", "loadtest", "--model", str(bad),
                           "--port", "1"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, model.CACHE_ENV: str(tmp_path / "cache")})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "cannot read the model file" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_a_derivation_past_its_time_is_a_value_error_too(tmp_path, monkeypatch):
    monkeypatch.setenv(model.CACHE_ENV, str(tmp_path))
    with pytest.raises(ValueError, match="took longer than 0.01 s"):
        derive_apart(str(bundled_model_path(SMOLLM2_BUNDLED)), timeout_s=0.01)
