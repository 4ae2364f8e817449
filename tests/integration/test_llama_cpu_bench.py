"""bench/llama_cpu.py against the real CPU llama-server and the bundled model, tiny cases: the timings it
reads are the server's own, a repeated prompt is prefilled in full every time (cache_prompt false), and
concurrent streams each generate exactly what was asked."""
import pytest

from bench.engine_cpu import decode_prompts, prefill_prompt
from bench.llama_cpu import LlamaCpu
from tests.integration.llama_server_helpers import llama_server_binary
from workers.protocol.model import load_model_info

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


async def test_rates_come_from_the_servers_timings(tmp_path):
    llama_server_binary()  # skip (or fail under CI) when the binary is not built
    info = load_model_info()
    srv = LlamaCpu(info.path, threads=1, log_dir=tmp_path)
    await srv.start()
    try:
        prompt = prefill_prompt(info, 64)
        for _ in range(2):  # the second time the same prompt must still be prefilled in full
            p = await srv.prefill(prompt)
            assert p["wall"] > 0 and p["cpu"] > 0
        one = await srv.decode(decode_prompts(info, 1), 8)
        assert one["wall"] > 0 and one["cpu"] > 0 and one["wall, whole requests"] > 0
        four = await srv.decode(decode_prompts(info, 4), 6)
        assert four["wall"] > 0 and four["cpu"] > 0
    finally:
        await srv.stop()
    assert srv.process.pid is None
