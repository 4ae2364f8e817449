"""bench/engine_gc.py end to end at a toy size: each variant in a process of its own, one table row per variant, and
the freeze visible in what the collector walks (a smoke test of the instrument; its figures are BENCHMARKS.md's)."""
from __future__ import annotations

from bench import engine_gc


def test_engine_gc_prints_a_row_per_variant_and_the_quiet_one_walks_fewer_objects(capsys):
    assert engine_gc.main(["--batch", "8", "--queue", "4", "--kv-tokens", "65536", "--seconds", "1", "--warmup",
                           "0.5", "--repeats", "1"]) == 0
    rows = {line.split("|")[1].strip(): line.split("|") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| quiet") or line.startswith("| default")}
    assert set(rows) == {"quiet", "default"}
    walked = {v: int(cells[-2].split()[0].replace(",", "")) for v, cells in rows.items()}
    # the default walks the KV pools' 4,096 block objects and everything imported; quiet froze them
    assert walked["default"] > walked["quiet"] + 4096
    steps = {v: float(cells[2].split()[0].replace(",", "")) for v, cells in rows.items()}
    assert min(steps.values()) > 0  # both stepped
