"""llama-server gap bench: the plan of servers and configurations, the counters it reads, batched-bench's
rows, and the per-repeat comparison with batched-bench."""
import pytest

from bench.llama_server_gap import (
    CUDA_PROFILE_ARGS, batched_bench_rows, decode_figures, kv_tokens, parse_metrics, plan, prompt_ids, summarize,
)
from policy.profiles import builtin_profiles


def test_the_gpu_servers_run_the_cuda_profiles_flags():
    """All of them but --backend-sampling, which the plan adds as a server of its own to measure it."""
    assert [*CUDA_PROFILE_ARGS, "--backend-sampling"] == builtin_profiles()["cuda"].llama_server_args


def test_plan_isolates_slots_queueing_sampling_and_streaming():
    p = plan([8, 32, 64], backend_sampling=True, extra_args=["-b", "256"])
    assert {n: (s.slots, s.args) for n, s in p.servers.items()} == {
        "np8": (8, ()), "np32": (32, ()), "np64": (64, ()), "np64-bs": (64, ("--backend-sampling",)),
        "np64-x": (64, ("-b", "256"))}
    got = {c.name: (c.server, c.clients, c.sampling, c.stream) for c in p.configs}
    assert got == {
        "np8@8": ("np8", 8, "pulse", True), "np32@32": ("np32", 32, "pulse", True),
        "np64@64": ("np64", 64, "pulse", True), "np8@64": ("np8", 64, "pulse", True),
        "np64@64/greedy": ("np64", 64, "greedy", True), "np64@64/stock": ("np64", 64, "stock", True),
        "np64@64/nostream": ("np64", 64, "pulse", False), "np64-bs@64": ("np64-bs", 64, "pulse", True),
        "np64-bs@64/greedy": ("np64-bs", 64, "greedy", True), "np64-x@64": ("np64-x", 64, "pulse", True)}
    one = plan([4], backend_sampling=False)
    assert list(one.servers) == ["np4"] and [c.name for c in one.configs] == [
        "np4@4", "np4@4/greedy", "np4@4/stock", "np4@4/nostream"]
    with pytest.raises(ValueError):
        plan([])


def test_kv_pool_holds_every_slot_and_prompt_ids_are_fixed():
    assert kv_tokens(64, 128, 32) == 11264 and kv_tokens(64, 128, 32) >= 64 * (128 + 32)
    assert kv_tokens(1, 16, 4) == 256
    ids = prompt_ids(128)
    assert len(ids) == 128 and ids[0] == 2 and ids == prompt_ids(128) and all(0 < i < 262_144 for i in ids)


def test_metrics_text_and_decode_figures():
    text = ("# HELP llamacpp:n_decode_total Total number of llama_decode() calls\n"
            "# TYPE llamacpp:n_decode_total counter\nllamacpp:n_decode_total 120\n"
            "llamacpp:tokens_predicted_total 2048\nllamacpp:n_busy_slots_per_decode 15.5\n")
    m = parse_metrics(text)
    assert m == {"n_decode_total": 120.0, "tokens_predicted_total": 2048.0, "n_busy_slots_per_decode": 15.5}
    after = {"n_decode_total": 152.0, "tokens_predicted_total": 4096.0}
    assert decode_figures(m, after, wall_s=0.8) == {"decode_calls": 32.0, "tokens_per_decode": 64.0,
                                                    "ms_per_decode": 25.0}
    assert decode_figures({}, {}, 1.0)["tokens_per_decode"] is None


def test_batched_bench_jsonl_rows():
    # the line format of tools/batched-bench/batched-bench.cpp (llama.cpp 11434), and a log line to skip
    out = ("main: n_kv_max = 11264\n"
           '{"n_kv_max": 11264, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 1, "is_pp_shared": 0, '
           '"n_gpu_layers": 99, "n_threads": 16, "n_threads_batch": 16, "pp": 128, "tg": 32, "pl": 64, '
           '"n_kv": 10240, "t_pp": 0.100000, "speed_pp": 81920.0, "t_tg": 0.200000, "speed_tg": 10240.0, '
           '"t": 0.300000, "speed": 34133.3}\n')
    assert batched_bench_rows(out) == pytest.approx(
        {"bb_speed_tg@64": 10240.0, "bb_ms_per_step@64": 6.25, "bb_speed@64": 34133.3})


def test_each_config_is_compared_with_batched_bench_of_the_same_repeat_at_its_client_count():
    p = plan([8, 64], backend_sampling=False)

    def rec(repeat, config, metrics, phase="measure"):
        return {"phase": phase, "repeat": repeat, "config": config, "metrics": metrics}

    records = [rec(0, "np64@64", {"gen_tok_s": 1.0}, "warmup"), rec(0, "batched-bench", {"bb_speed_tg@64": 1.0,
               "bb_ms_per_step@64": 1.0, "bb_speed_tg@8": 1.0, "bb_ms_per_step@8": 1.0}, "warmup")]
    for r in range(5):
        records += [rec(r, "np64@64", {"gen_tok_s": 1000.0 + r}), rec(r, "np8@8", {"gen_tok_s": 500.0}),
                    rec(r, "np8@64", {"gen_tok_s": 400.0}),
                    rec(r, "batched-bench", {"bb_speed_tg@64": 10000.0 * (r + 1), "bb_ms_per_step@64": 6.0,
                                             "bb_speed_tg@8": 1000.0, "bb_ms_per_step@8": 2.0})]
    s = summarize(records, p.configs)
    assert list(s) == ["np8@8", "np64@64", "np8@64", "batched-bench"]
    # repeat r: (1000 + r) / (10000 (r + 1)): 0.1, 0.05, 0.0334, 0.025, 0.0202 -> median 0.0334
    assert s["np64@64"]["vs_batched_bench"]["median"] == pytest.approx(1002 / 30000)
    assert s["np64@64"]["vs_batched_bench"]["max"] == pytest.approx(0.1)
    assert s["np8@8"]["vs_batched_bench"]["median"] == 0.5 and s["np8@8"]["bb_ms_per_step"]["median"] == 2.0
    # 8 slots, 64 clients: compared with batched-bench at 64 (what the clients asked for)
    assert s["np8@64"]["bb_ms_per_step"]["median"] == 6.0
