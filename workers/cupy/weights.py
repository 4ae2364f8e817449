"""GGUF weights: dequantized once with the `gguf` library, cached on disk as .npy, memory-mapped after that.

Opening a GGUFReader on the bundled model costs ~20 s on a 2-core box and dequantizing every tensor ~6 s,
so the fp32 result is written under the model's cache folder and later starts map it back in well under a
second. Memory-mapped, read-only arrays also let several engine processes on one box share one copy of the
weights through the page cache.

Arrays the model derives from the tensors at load (the NumPy path concatenates q/k/v and gate/up and
transposes every layer matrix for OpenBLAS) would be private copies in each process: ~475 MB per CPU
worker for the bundled model, so N workers on one box cost N copies. `WeightMap.derived` stores such an
array once under `derived/` in the same cache folder and memory-maps it, so every worker shares it too.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from workers.protocol.model import model_cache_dir

log = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when the cached layout changes
_MANIFEST = "manifest.json"


def weights_cache_dir(gguf_path: Path, cache_dir: str | None = None) -> Path:
    """Folder holding the dequantized tensors of one GGUF file (keyed by path, size and mtime)."""
    base = model_cache_dir(gguf_path)
    d = (Path(cache_dir).expanduser() / base.name if cache_dir else base) / f"fp32-v{CACHE_FORMAT}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _file_name(tensor_name: str) -> str:
    return tensor_name.replace("/", "_") + ".npy"


def _dequantize_all(gguf_path: Path, out: Path) -> None:
    """Read every tensor, dequantize to fp32 and write one .npy each; the manifest is written last."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from tqdm import tqdm

    log.info("opening %s (first start: the dequantized weights are cached in %s)", gguf_path, out)
    reader = GGUFReader(str(gguf_path))
    manifest = {}
    for t in tqdm(reader.tensors, desc="dequantizing weights", unit="tensor", disable=None):
        arr = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        # gguf lists dims fastest-first; dequantize already returns row-major (out, in) for matrices
        shape = [int(d) for d in reversed(t.shape)]
        arr = arr.reshape(shape)
        tmp = out / f"{_file_name(t.name)}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            np.save(f, arr)
        tmp.replace(out / _file_name(t.name))
        manifest[t.name] = {"shape": shape, "type": t.tensor_type.name}
    tmp = out / f"{_MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"format": CACHE_FORMAT, "tensors": manifest}))
    tmp.replace(out / _MANIFEST)


class WeightMap(dict):
    """The tensors by GGUF name (a dict of read-only memory maps), plus a disk cache for derived arrays."""

    def __init__(self, tensors: dict[str, np.ndarray], folder: Path):
        super().__init__(tensors)
        self.folder = folder

    def derived(self, key: str, build: Callable[[], np.ndarray]) -> np.ndarray:
        """`build()` computed once per cache folder and memory-mapped read-only from then on (shared by
        every process that maps it). `key` must name everything the result depends on (tensor names,
        layout, dtype): a stored array is never checked against `build`."""
        if not re.fullmatch(r"[A-Za-z0-9_.+-]+", key):
            raise ValueError(f"derived weight key {key!r}: letters, digits and _.+- only")
        path = self.folder / "derived" / f"{key}.npy"
        if not path.exists():
            arr = np.ascontiguousarray(build())
            path.parent.mkdir(exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # workers starting together: last rename wins
            with open(tmp, "wb") as f:
                np.save(f, arr)
            tmp.replace(path)
        return np.load(path, mmap_mode="r")


def load_weights(gguf_path: str | os.PathLike, cache_dir: str | None = None) -> WeightMap:
    """Every tensor of the file as a read-only fp32 host array, by GGUF name (e.g. 'blk.0.attn_q.weight')."""
    path = Path(gguf_path)
    out = weights_cache_dir(path, cache_dir)
    if not (out / _MANIFEST).exists():
        # Workers starting together on a cold cache (4 servers x 4 workers on one box): one dequantizes
        # while the others wait on the lock, then all read its files.
        with open(out / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / _MANIFEST).exists():
                _dequantize_all(path, out)
    manifest = json.loads((out / _MANIFEST).read_text())["tensors"]
    weights = WeightMap({name: np.load(out / _file_name(name), mmap_mode="r") for name in manifest}, out)
    log.info("loaded %d tensors from %s", len(weights), out)
    return weights
