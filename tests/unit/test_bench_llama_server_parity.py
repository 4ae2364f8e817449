"""bench.llama_server_parity's pure parts: the cells it runs, the pairing per repeat, the verdict."""
from __future__ import annotations

import pytest

from bench.llama_server_parity import _parse, derive, specs, summarize, verdict
from bench.loadgen import request_body


def rec(config: str, repeat: int, tok_s: float, p50: float, p99: float, errors: int = 0) -> dict:
    return {"phase": "measure", "repeat": repeat, "config": config,
            "metrics": {"tok_s": tok_s, "ttft_p50_ms": p50, "ttft_p99_ms": p99, "errors": errors}}


def test_cells_send_the_same_request_both_ways():
    args = _parse(["--clients", "1", "8", "--modes", "greedy", "t1exact", "--apis", "completions", "chat",
                   "--tokens", "8"])
    cells = specs(args, [2, 10, 11], "http://127.0.0.1:1", "gemma", "http://127.0.0.1:2")
    assert len(cells) == 2 * 2 * 2 * 2
    d, p = cells["direct/completions/greedy@8"], cells["pulse/completions/greedy@8"]
    assert d.url.endswith(":2") and p.url.endswith(":1") and d.force_close and d.clients == p.clients == 8
    assert request_body(d) == request_body(p)  # same path, same body: only the server differs
    assert request_body(p)[0] == "/v1/completions" and request_body(p)[1]["prompt"] == [2, 10, 11]
    # t1exact: direct is told OpenAI's full distribution explicitly (llama-server's defaults would cut it)
    _, direct_body = request_body(cells["direct/chat/t1exact@1"])
    path, pulse_body = request_body(cells["pulse/chat/t1exact@1"])
    assert path == "/v1/chat/completions" and pulse_body["temperature"] == 1.0 and "top_k" not in pulse_body
    assert (direct_body["top_k"], direct_body["top_p"], direct_body["min_p"]) == (0, 1.0, 0.0)
    assert cells["pulse/chat/t1exact@8"].requests == 8 * 3


def test_pairs_stay_within_a_repeat_and_the_verdict_reads_the_goals():
    records = [rec("direct/completions/greedy@1", 0, 100.0, 50.0, 80.0),
               rec("pulse/completions/greedy@1", 0, 97.0, 51.0, 85.0),
               rec("direct/completions/greedy@1", 1, 200.0, 40.0, 60.0),
               rec("pulse/completions/greedy@1", 1, 194.0, 41.5, 61.0),
               rec("direct/completions/t1@1", 0, 100.0, 50.0, 80.0),
               rec("pulse/completions/t1@1", 0, 80.0, 60.0, 90.0, errors=2)]
    d = {(r["config"], r["repeat"]): r["metrics"] for r in derive(records)}
    assert d[("pulse/completions/greedy@1", 1)] == {"added_ttft_p50_ms": 1.5, "added_ttft_p99_ms": 1.0,
                                                     "tok_s_ratio": 0.97}
    summary = summarize(records, ["direct/completions/greedy@1", "pulse/completions/greedy@1",
                                  "direct/completions/t1@1", "pulse/completions/t1@1"])
    assert list(summary) == ["direct/completions/greedy@1", "pulse/completions/greedy@1",
                             "direct/completions/t1@1", "pulse/completions/t1@1"]
    lines = verdict(summary)
    assert lines[0].startswith("MET  pulse/completions/greedy@1: tok/s x0.97")
    assert lines[1].startswith("MISS pulse/completions/t1@1") and lines[1].endswith("errors (worst repeat, both) 2")
    assert verdict({"pulse/chat/t1@64": {}}) == ["NONE pulse/chat/t1@64: a target served nothing"]


def test_variants_get_their_own_targets_and_are_set_against_variant_0():
    from bench.llama_server_parity import config_yaml, direct_of

    args = _parse(["--clients", "8", "--modes", "t1exact", "--variants", "", "--cache-ram 0"])
    assert args.variants == ["", "--cache-ram 0"]
    v1 = specs(args, [2, 10], "http://127.0.0.1:3", "gemma", "http://127.0.0.1:4", 1)
    assert set(v1) == {"direct.v1/completions/t1exact@8", "pulse.v1/completions/t1exact@8"}
    assert direct_of("pulse.v1/completions/t1exact@8") == "direct.v1/completions/t1exact@8"
    assert direct_of("direct.v1/completions/t1exact@8") is None
    import json
    from pathlib import Path
    flags = json.loads(config_yaml(args, Path("/tmp"), "--cache-ram 0"))["workers"]["llama_server"]["extra_args"]
    assert flags == ["--log-timestamps", "--cache-ram", "0"]  # after the profile's flags: the later one wins
    ls = json.loads(config_yaml(args, Path("/tmp"), "=-fa on --cache-ram 0"))["workers"]["llama_server"]
    assert ls["profile_args"] == ["-fa", "on", "--cache-ram", "0"] and ls["extra_args"] == ["--log-timestamps"]
    assert "profile_args" not in json.loads(config_yaml(args, Path("/tmp"), ""))["workers"]["llama_server"]
    assert "server" not in json.loads(config_yaml(args, Path("/tmp"), ""))  # the box's replicas
    four = json.loads(config_yaml(_parse(["--gateway-replicas", "4"]), Path("/tmp"), ""))
    assert four["server"] == {"gateway_replicas": 4}
    from policy.config import PulseConfig
    assert PulseConfig.model_validate(four).server.gateway_replicas == 4
    # a variant's own binary (--variant-binaries) takes the place of --binary's
    assert "binary" not in json.loads(config_yaml(args, Path("/tmp"), ""))["workers"]["llama_server"]
    assert json.loads(config_yaml(args, Path("/tmp"), "", "/opt/up/llama-server"))["workers"]["llama_server"][
        "binary"] == "/opt/up/llama-server"
    with pytest.raises(SystemExit):
        _parse(["--variants", "", "--variant-binaries", "/a", "/b"])
    # a variant's own admission.worker_queue_max (--variant-worker-queues): none set unless given, 0 kept as 0
    assert "worker_queue_max" not in json.loads(config_yaml(args, Path("/tmp"), "")).get("admission", {})
    assert json.loads(config_yaml(args, Path("/tmp"), "", None, 0))["admission"]["worker_queue_max"] == 0
    assert _parse(["--variants", "", "", "--variant-worker-queues", "", "0"]).variant_worker_queues == ["", "0"]
    for bad in (["--variant-worker-queues", "1", "2"], ["--variants", "", "", "--variant-worker-queues", "x"]):
        with pytest.raises(SystemExit):
            _parse(bad)
    # a variant's own workers.llama_server.hold_ms (--variant-holds): Pulse's default unless given, 0 kept as 0
    assert "hold_ms" not in json.loads(config_yaml(args, Path("/tmp"), ""))["workers"]["llama_server"]
    assert json.loads(config_yaml(args, Path("/tmp"), "", None, None, 0.0))["workers"]["llama_server"]["hold_ms"] == 0
    assert _parse(["--variants", "", "", "--variant-holds", "", "0"]).variant_holds == ["", "0"]
    for bad in (["--variant-holds", "1", "2"], ["--variants", "", "", "--variant-holds", "x"]):
        with pytest.raises(SystemExit):
            _parse(bad)
    # a variant's own Pulse settings (--variant-configs), merged mapping by mapping over the rest
    more = _parse(["--variants", "", "", "--variant-configs", "", '{"admission": {"gateway_order_s": null}}'])
    assert more.variant_configs == [{}, {"admission": {"gateway_order_s": None}}]
    doc = json.loads(config_yaml(args, Path("/tmp"), "", None, 0, None, more.variant_configs[1]))
    assert doc["admission"] == {"worker_queue_max": 0, "gateway_order_s": None}
    assert PulseConfig.model_validate(doc).admission.gateway_order_s is None
    assert PulseConfig.model_validate(json.loads(config_yaml(args, Path("/tmp"), ""))).admission.gateway_order_s
    for bad in (["--variant-configs", "{}", "{}"], ["--variants", "", "", "--variant-configs", "", "[1]"],
                ["--variants", "", "", "--variant-configs", "", "{x"]):
        with pytest.raises(SystemExit):
            _parse(bad)
    records = [rec("direct/completions/t1exact@8", 0, 500.0, 300.0, 400.0),
               rec("pulse/completions/t1exact@8", 0, 450.0, 320.0, 420.0),
               rec("direct.v1/completions/t1exact@8", 0, 750.0, 100.0, 150.0),
               rec("pulse.v1/completions/t1exact@8", 0, 750.0, 101.0, 160.0)]
    d = {(r["config"], r["repeat"]): r["metrics"] for r in derive(records)}
    assert d[("direct.v1/completions/t1exact@8", 0)] == {"tok_s_vs_v0": 1.5}
    assert d[("pulse.v1/completions/t1exact@8", 0)]["tok_s_ratio"] == 1.0  # paired with its own variant's direct
    assert d[("pulse/completions/t1exact@8", 0)]["tok_s_ratio"] == 0.9
    lines = verdict(summarize(records, [r["config"] for r in records]))
    assert lines[0].startswith("MISS pulse/completions/t1exact@8: tok/s x0.90")
    assert lines[1] == "VS0  direct.v1/completions/t1exact@8: tok/s x1.50 (1.50-1.50) of variant 0's direct"
    assert lines[2].startswith("MET  pulse.v1/completions/t1exact@8: tok/s x1.00")  # 1.00x and +1 ms: the goals


def test_think_time_cells_pair_with_their_own_direct():
    args = _parse(["--clients", "8", "--modes", "greedy", "--think-ms", "0", "50"])
    cells = specs(args, [2, 10, 11], "http://127.0.0.1:1", "gemma", "http://127.0.0.1:2")
    assert sorted(cells) == ["direct/completions/greedy@8", "direct/completions/greedy@8+think50",
                             "pulse/completions/greedy@8", "pulse/completions/greedy@8+think50"]
    assert cells["pulse/completions/greedy@8"].think_s == 0.0
    thinking = cells["pulse/completions/greedy@8+think50"], cells["direct/completions/greedy@8+think50"]
    assert thinking[0].think_s == thinking[1].think_s == 0.05
    records = [rec("direct/completions/greedy@8+think50", 0, 100.0, 50.0, 80.0),
               rec("pulse/completions/greedy@8+think50", 0, 98.0, 52.0, 81.0)]
    d = {r["config"]: r["metrics"] for r in derive(records)}
    assert d["pulse/completions/greedy@8+think50"]["added_ttft_p50_ms"] == 2.0


def test_a_runs_slice_of_the_server_log_counts_its_launch_groups(tmp_path):
    """Launches within 1 ms of each other came between the same two steps: one group. Only the run's byte range
    of the log counts."""
    from bench.llama_server_log import launch_groups, parse, slice_metrics

    def launch(ts: str, slot: int, task: int, prompt_ms: float) -> list[str]:
        return [f"{ts}.000 I slot get_availabl: id  {slot} | task -1 | selected slot by id ({slot})",
                f"{ts}.050 I slot launch_slot_: id  {slot} | task {task} | processing task, is_child = 0",
                f"0.59.000.000 I slot print_timing: id  {slot} | task {task} | prompt eval time =     {prompt_ms} ms /"
                "     5 tokens (    1.00 ms per token,   5.00 tokens per second)"]
    before = launch("0.01.000", 9, 1, 50.0)
    # one request named slot 1 while it was busy: picked, deferred (no launch), retried later
    deferred = ["0.02.010.000 I slot get_availabl: id  1 | task -1 | selected slot by id (1)"]
    run = (launch("0.02.000", 0, 10, 70.0) + launch("0.02.000", 1, 11, 70.0) + deferred
           + launch("0.02.071", 2, 12, 140.0))
    log = tmp_path / "llama-server-w.log"
    log.write_text("\n".join(before) + "\n")
    start = log.stat().st_size
    log.write_text(log.read_text() + "\n".join(run) + "\n")
    assert launch_groups(parse(run)) == [2, 1]
    m = slice_metrics(log, start, log.stat().st_size)
    assert m == {"server_launches": 3, "launch_groups": 2, "launches_per_group": 1.5, "deferred_picks": 1,
                 "server_prompt_p50_ms": 70.0}
    assert slice_metrics(log, start, start) == {}
    # with -lv 4 the server logs each re-reserve of its compute graphs: counted and summed per run
    log.write_text(log.read_text() + "0.03.000.000 I sched_reserve: reserve took 80.50 ms, sched copies = 1\n"
                   + "\n".join(launch("0.03.100", 3, 13, 90.0)) + "\n"
                   + "0.03.200.000 I sched_reserve: reserve took 1.50 ms, sched copies = 1\n")
    m = slice_metrics(log, start, log.stat().st_size)
    assert m["server_reserves"] == 2 and m["server_reserve_ms"] == 82.0 and m["server_launches"] == 4
