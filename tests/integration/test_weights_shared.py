"""Derived weights (packed layer matrices) are stored once and memory-mapped, so N CPU workers on one box
share one copy through the page cache instead of each holding ~475 MB of private concatenations."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from workers.cupy.models import build_model
from workers.cupy.ops import Ops
from workers.cupy.weights import WeightMap
from workers.protocol.model import load_model_info


def test_derived_is_built_once_and_mapped_read_only(tmp_path):
    weights = WeightMap({}, tmp_path)
    calls = []

    def build():
        calls.append(1)
        return np.arange(12, dtype=np.float32).reshape(3, 4).T

    first = weights.derived("blk.0.x+y.in_out.float32", build)
    second = weights.derived("blk.0.x+y.in_out.float32", build)
    assert calls == [1]
    assert isinstance(second, np.memmap) and not second.flags.writeable
    np.testing.assert_array_equal(first, np.arange(12, dtype=np.float32).reshape(3, 4).T)
    np.testing.assert_array_equal(second, first)
    with pytest.raises(ValueError):
        weights.derived("../escape", build)


def test_model_matrices_match_a_plain_dict_build(tmp_path):
    """The real model: matrices from the derived cache equal those built from a plain dict of the same
    tensors (the pre-cache path), and they are file-backed maps, not private copies."""
    from workers.cupy.weights import load_weights

    info = load_model_info(None)
    mapped = load_weights(info.path)
    cached = build_model(info, mapped, Ops(np))
    plain = build_model(info, dict(mapped), Ops(np))
    for name in ("qkv", "o", "gate_up", "down"):
        for i in (0, len(cached.layers) - 1):
            a, b = cached.layers[i][name], plain.layers[i][name]
            assert isinstance(a, np.memmap), name
            assert a.shape == b.shape and a.flags.c_contiguous
            np.testing.assert_array_equal(a, b)


_CHILD = """
import os, numpy as np
from workers.cupy.models import build_model
from workers.cupy.ops import Ops
from workers.cupy.weights import load_weights
from workers.protocol.model import load_model_info
info = load_model_info(None)
build_model(info, load_weights(info.path), Ops(np))
anon = [int(l.split()[1]) for l in open(f"/proc/{os.getpid()}/smaps_rollup") if l.startswith("Anonymous:")][0]
print(anon)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux smaps_rollup")
def test_a_worker_process_holds_no_private_copy_of_the_layers():
    """A fresh process building the CPU model adds well under the ~475 MB the packed layers take."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    for _ in range(2):  # the first run may build the cache; the second must only map it
        out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, check=True)
    anon_mb = int(out.stdout.split()[-1]) / 1024
    assert anon_mb < 150, f"{anon_mb:.0f} MB anonymous memory after building the model"


_LOADER = """
import sys
from workers.cupy.weights import load_weights
from workers.protocol.model import load_model_info
print(len(load_weights(load_model_info(None).path, sys.argv[1])))
"""


def test_workers_starting_together_on_a_cold_cache_all_load(tmp_path):
    """Found on the H200 (16 workers of 4 servers starting at once): every process dequantized into the same
    temporary file names and all but one failed their rename. Now one dequantizes under a lock and the rest
    wait for it; all three processes here load the same tensors."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _LOADER, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(3)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in outs]
    counts = {out.split()[-1] for out, _ in outs}
    assert len(counts) == 1 and int(counts.pop()) > 100
    assert not list(tmp_path.rglob("*.tmp"))
