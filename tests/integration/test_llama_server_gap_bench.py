"""bench/llama_server_gap.py end to end on the CPU llama-server, tiny settings: the servers start with Pulse's
worker flags, every configuration generates exactly --tokens per request, the /metrics counters move, and the
JSON result is written."""
import json

import pytest

from bench import llama_server_gap
from tests.integration.llama_server_helpers import llama_server_binary

pytestmark = pytest.mark.slow


def test_gap_bench_runs_on_the_cpu_llama_server(tmp_path, capsys):
    binary = llama_server_binary()
    rc = llama_server_gap.main(["--server", str(binary), "--slots", "1", "--tokens", "3", "--prompt-tokens", "8",
                                "--threads", "1", "--repeats", "1", "--warmup", "0", "--no-backend-sampling",
                                "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    doc = json.loads(next(tmp_path.glob("llama_server_gap-*.json")).read_text())
    assert set(doc["summary"]) == {"np1@1", "np1@1/greedy", "np1@1/stock", "np1@1/nostream"}
    for name, s in doc["summary"].items():
        assert s["errors"]["median"] == 0 and s["tokens_per_req"]["median"] == pytest.approx(3), (name, s)
        assert s["gen_tok_s"]["median"] > 0 and s["decode_calls"]["median"] >= 3, (name, s)
    argv = doc["params"]["servers"]["np1"]
    assert "--kv-unified" in argv and "--no-cache-idle-slots" in argv and "--metrics" in argv
    assert "| np1@1/nostream |" in capsys.readouterr().out


def test_runs_past_the_budget_are_skipped_not_measured(tmp_path, capsys):
    binary = llama_server_binary()
    rc = llama_server_gap.main(["--server", str(binary), "--slots", "1", "--tokens", "2", "--prompt-tokens", "8",
                                "--threads", "1", "--repeats", "1", "--warmup", "0", "--no-backend-sampling",
                                "--budget-s", "0", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    doc = json.loads(next(tmp_path.glob("llama_server_gap-*.json")).read_text())
    assert doc["summary"] == {} and all(r["detail"]["skipped"] for r in doc["records"])
    assert "4 of 4 runs skipped" in capsys.readouterr().err
