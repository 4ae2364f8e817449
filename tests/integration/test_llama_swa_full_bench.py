"""bench/llama_swa_full.py end to end on the CPU llama-server and the bundled Gemma 3 (a sliding-window model),
tiny settings: both variants run, every measure is a real timing from llama-server, the JSON keeps each run, and
--swa-full reaches the server only in its variant."""
import json

import pytest

from bench import llama_swa_full
from tests.integration.llama_server_helpers import llama_server_binary
from workers.protocol.model import bundled_model_path

pytestmark = pytest.mark.slow


def test_swa_full_bench_runs_both_variants_on_the_cpu_llama_server(tmp_path, capsys):
    rc = llama_swa_full.main(["--binary", str(llama_server_binary()), "--model", str(bundled_model_path()),
                              "--args", "-np 2 -c 2048 --kv-unified -t 1 --cache-ram 0", "--contexts", "40",
                              "--clients", "2", "--tokens", "3", "--turns", "1", "--rounds", "1", "--repeats", "1",
                              "--log-dir", str(tmp_path / "logs"), "--json", str(tmp_path / "runs.json")])
    assert rc == 0
    runs = json.loads((tmp_path / "runs.json").read_text())["runs"]
    assert set(runs) == {"window", "swa-full"}
    for variant, (run,) in runs.items():
        assert set(run) == {"ctx40_retry_prompt_ms", "ctx40_decode_ms", "ctx40_next_prompt_ms", "c2_tok_s",
                            "c2_prompt_ms_p50"}, variant
        assert all(v > 0 for v in run.values()), (variant, run)
    out = capsys.readouterr().out
    assert "| ctx40_retry_prompt_ms |" in out and "| c2_tok_s |" in out
    # llama-server logs the context it builds: a full-size window cache only where the flag was given
    logs = {f.name: f.read_text(errors="replace") for f in (tmp_path / "logs").glob("*.log")}
    full = {name for name, text in logs.items() if "using full-size SWA cache" in text}
    assert full == {"llama-server-swa-full-0.log"}
    assert set(logs) == {"llama-server-window-0.log", "llama-server-swa-full-0.log"}


def test_swa_full_bench_refuses_the_flag_in_the_shared_args():
    with pytest.raises(SystemExit):
        llama_swa_full.main(["--binary", "x", "--model", "y", "--args", "-np 2 --swa-full"])
