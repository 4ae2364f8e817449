"""bench/served.py's pure parts: distinct prompts per request, the request bodies per target, the pivot."""
from __future__ import annotations

import pytest

from bench.served import _parse, att_env, batch_of, body_extra, config_name, pivot, prompts, pulse_config
from pulse.config import load_config


@pytest.mark.parametrize("workload, api", [("story", "completions"), ("code", "completions"), ("json", "chat")])
def test_prompts_are_distinct_from_their_first_words(workload, api):
    got_api, texts = prompts(workload, 40)
    assert got_api == api and len(texts) == 40
    assert len({t.split(".")[0] if workload != "code" else t[:40] for t in texts}) == 40  # no shared prefix


def test_bodies_follow_the_target_workload_and_sampling():
    assert body_extra("pulse", "story", "t1") == {"temperature": 1.0, "ignore_eos": True}  # no top_k / top_p
    assert body_extra("pulse-k0", "story", "greedy")["max_draft_tokens"] == 0
    assert body_extra("pulse-k8", "code", "greedy")["max_draft_tokens"] == 8
    assert "max_draft_tokens" not in body_extra("llama", "code", "greedy")
    assert body_extra("llama", "json", "t1")["response_format"]["type"] == "json_schema"


def test_worker_queue_reaches_the_served_config_and_pulse_q4_sets_4(tmp_path):
    args = _parse(["--targets", "pulse", "pulse-q4", "--worker-queue", "128", "--profile-batch"])
    main = load_config(pulse_config(args, 8123, tmp_path, "on", "on", {"worker_queue_max": args.worker_queue}))
    q4 = load_config(pulse_config(args, 8124, tmp_path, "on", "q4", {"worker_queue_max": 4}))
    plain = load_config(pulse_config(args, 8125, tmp_path, "on", "plain"))
    assert (main.admission.worker_queue_max, q4.admission.worker_queue_max) == (128, 4)
    assert plain.admission.worker_queue_max is None  # nothing set: the worker's profile decides


def test_a_pulse_bn_target_runs_its_engine_at_a_batch_of_n_and_others_are_refused(tmp_path, capsys):
    args = _parse(["--targets", "pulse", "pulse-b192", "--profile-batch", "--clients", "1000"])
    assert args.targets == ["pulse", "pulse-b192"] and batch_of("pulse-b192") == 192
    b192 = load_config(pulse_config(args, 8126, tmp_path, "on", "b192", {}, max_num_seqs=batch_of("pulse-b192")))
    assert b192.workers.engine.max_num_seqs == 192
    # without --profile-batch the batch is the largest client count, unless the target sets its own
    args = _parse(["--targets", "pulse", "pulse-b192", "--clients", "1000"])
    def batch(**engine):
        return load_config(pulse_config(args, 8127, tmp_path, "on", "x", {}, **engine)).workers.engine.max_num_seqs

    assert (batch(max_num_seqs=192), batch()) == (192, 1000)
    for bad in ("pulse-b0", "pulse-bx", "pulse-b"):
        with pytest.raises(SystemExit):
            _parse(["--targets", bad])
        assert "unknown target" in capsys.readouterr().err


def test_pulse_w2_runs_two_workers_on_the_device(tmp_path):
    args = _parse(["--targets", "pulse", "pulse-w2", "--profile-batch"])
    assert load_config(pulse_config(args, 8128, tmp_path, "on", "w2", {}, workers=2)).workers.count == 2
    assert load_config(pulse_config(args, 8129, tmp_path, "on", "on", {})).workers.count == 1


def test_the_att_variant_becomes_the_kernels_environment_and_a_malformed_one_is_refused():
    args = _parse(["--targets", "pulse", "pulse-att", "--att-variant", "MIN_BLOCKS=2 UNROLL=2"])
    assert att_env(args.att_variant) == {"PULSE_GPU_ATT_MIN_BLOCKS": "2", "PULSE_GPU_ATT_UNROLL": "2"}
    assert att_env("") == {}
    for bad in ("MIN_BLOCKS", "MIN_BLOCKS=", "=2", "A-B=1"):
        with pytest.raises(ValueError, match="KEY=VALUE"):
            att_env(bad)


def test_pivot_has_a_row_per_cell_and_a_column_group_per_target():
    class A:
        targets, workloads, sampling, clients = ["pulse", "llama"], ["story"], ["greedy", "t1"], [1, 8]

    summary = {config_name("pulse", "story", "t1", 8): {"tok_s": {"median": 900.0, "min": 800.0, "max": 1000.0}}}
    table = pivot(summary, A).splitlines()
    assert len(table) == 2 + 4
    assert "900 (800–1,000)" in next(line for line in table if "| t1 | 8 |" in line)


def test_engine_alone_runs_every_client_request_to_its_length():
    """bench/engine_batches.py's closed loop on the real engine (NumPy here): each of 2 clients sends its 2
    requests one after the other, and every request generates exactly its tokens (ignore_eos)."""
    from bench.engine_batches import build_engine, run_cell

    engine, tokenizer, info = build_engine(None, "cpu", "cpu", 2, speculation=True)
    _, texts = prompts("story", 4)
    ids = [[info.bos_token_id] + tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    generated, seconds = run_cell(engine, ids, batch=2, per_client=2, tokens=3, sampling={"temperature": 1.0},
                                  tag="t")
    assert generated == 2 * 2 * 3 and seconds > 0
    assert not engine.has_work()


def test_engine_alone_staggered_arrivals_start_each_client_later():
    """--arrivals staggered: client c's first request at step c x tokens / batch, so the run lasts that many steps
    longer than the one that starts every client at once, and still generates every token."""
    from bench.engine_batches import build_engine, run_cell

    engine, tokenizer, info = build_engine(None, "cpu", "cpu", 2, speculation=False)
    _, texts = prompts("story", 8)
    ids = [[info.bos_token_id] + tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    steps = {}
    for staggered, part in ((False, ids[:4]), (True, ids[4:])):
        before = engine.scheduler.steps
        generated, _ = run_cell(engine, part, batch=2, per_client=2, tokens=4, sampling={"temperature": 0.0},
                                tag=f"s{staggered}", staggered=staggered)
        assert generated == 2 * 2 * 4
        steps[staggered] = engine.scheduler.steps - before
    assert steps[True] == steps[False] + 4 // 2, steps  # client 1 joins at step 2: the run ends 2 steps later


def test_forwards_sums_paths_and_decoding_sequence_steps_over_gpu_workers():
    import http.server
    import json
    import threading

    from bench.served import ATTENTION, GC_SECONDS, PHASE, SEQ_STEPS, STEP_SECONDS, WAIT_SECONDS, forwards

    workers = {"workers": [
        {"stats": {"forwards_by_path": {"graph": 10, "eager": 2}, "steps_by_k": [30, 4, 2], "gc_seconds": 0.25,
                   "step_seconds": 2.0, "token_wait_seconds": 0.5, "step_phase_seconds": {"build": 0.25},
                   "attention_settings": {"ASYNC": 1}}},
        {"stats": {"forwards_by_path": {"graph": 5}, "steps_by_k": [7], "gc_seconds": 0.5}},  # an older worker
        {"stats": {"tokens_per_s": 1.0}},  # llama-server: no forwards, its steps are not counted
    ]}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(workers).encode() if self.path == "/pulse/workers" else b"{}"
            self.send_response(200 if self.path == "/pulse/workers" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        got = forwards(f"http://127.0.0.1:{srv.server_address[1]}")
    finally:
        srv.shutdown()
        srv.server_close()
    assert got == {"graph": 15, "eager": 2, SEQ_STEPS: 43, GC_SECONDS: 0.75, STEP_SECONDS: 2.0, WAIT_SECONDS: 0.5,
                   PHASE + "build": 0.25, ATTENTION: {"ASYNC": 1}}
