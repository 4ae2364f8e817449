"""What /pulse/status says, from the gateway's real parts (pool state, metrics, admission gate, in-process
index) without a server: why a worker is out, draft acceptance, blocks indexed, minute figures, and
recent errors that keep tenant text out."""
from __future__ import annotations

import time

from cache.memory_index import MemoryPrefixIndex
from gateway.admission_gate import AdmissionGate
from gateway.metrics import GatewayMetrics
from gateway.pool import WorkerPool, WorkerState
from gateway.status import StatusBoard
from policy.config import AdmissionConfig
from workers.protocol import BackendStats, Usage, WorkerInfo


async def no_workers(worker_id):
    return []


def worker(wid: str, **stats) -> WorkerState:
    return WorkerState(WorkerInfo(worker_id=wid, url="http://127.0.0.1:1", backend="cupy", node_id="n1", device="cpu",
                                  device_id="cpu", model="m"), stats=BackendStats(**stats), last_seen=time.monotonic())


def board() -> StatusBoard:
    pool = WorkerPool(no_workers)
    up = worker("w-up", running=2, waiting=1, slots=4, kv_blocks_total=100, kv_blocks_used=40, tokens_per_s=12.5,
                speculation_k=3, drafted_by_position=[10, 6], accepted_by_position=[8, 4], queue_max=128)
    silent = worker("w-silent", tokens_per_s=99.0)
    silent.healthy = False  # its last poll failed
    sick = worker("w-sick", healthy=False)
    sick.healthy = False
    tripped = worker("w-tripped")
    tripped.failures, tripped.open_until = 3, time.monotonic() + 4
    pool.workers = {w.worker_id: w for w in (up, silent, sick, tripped)}
    return StatusBoard(pool, GatewayMetrics(), AdmissionGate(AdmissionConfig()), MemoryPrefixIndex(), auth=None,
                       models=lambda: ["m", "other"])


async def test_workers_say_why_they_are_out_and_how_drafts_fare():
    b = board()
    await b.index.publish("w-up", [1, 2, 3])
    rows = {w["id"]: w for w in b.snapshot()["workers"]}
    up = rows["w-up"]
    assert up["healthy"] and up["why"] == "" and up["models"] == ["m"]
    assert (up["running"], up["waiting"], up["kv_blocks_used"], up["kv_blocks_total"]) == (2, 1, 40, 100)
    assert up["acceptance"] == 0.75 and up["speculation_k"] == 3 and up["blocks_indexed"] == 3
    assert not rows["w-silent"]["healthy"] and "does not answer" in rows["w-silent"]["why"]
    assert rows["w-sick"]["why"] == "the backend reports itself unhealthy"
    assert not rows["w-tripped"]["healthy"] and rows["w-tripped"]["why"].startswith("circuit open after 3 failed")
    assert rows["w-silent"]["acceptance"] is None and rows["w-silent"]["blocks_indexed"] == 0
    # what the gateway sends beyond the slots: the worker's own figure, else 4 (admission.worker_queue_max unset)
    assert (up["queue"], rows["w-silent"]["queue"]) == (128, 4)


async def test_minute_figures_come_from_the_metrics_and_skip_unhealthy_workers():
    b = board()
    b.sample()
    rm = b.metrics.request("m", time.perf_counter() - 0.2)  # first token 200 ms after arrival
    rm.chunk(1)
    rm.finish(200, Usage(prompt_tokens=100, cached_tokens=25, completion_tokens=1))
    b.metrics.prefix_lookup(0.001, 50, 100)
    b.record("/v1/chat/completions", 200, None, None)
    b.sample()
    s = b.snapshot()
    g = s["gateway"]
    assert g["last_minute"]["requests"] == 1 and g["last_minute"]["ok"] == 1
    assert 100 <= g["ttft_ms"]["p50"] <= 250 and g["ttft_ms"]["count"] == 1
    assert s["index"]["cached_ratio"] == 0.25 and s["index"]["match_ratio"] == 0.5 and s["index"]["blocks"] == 0
    point = s["series"]["points"][-1]
    assert point[1] == 12.5 and point[3] == 1  # w-silent's stale 99 tokens/s is not counted
    assert s["models"] == ["m", "other"]


async def test_recent_errors_keep_codes_not_client_text():
    b = board()
    b.record("/v1/chat/completions", 404, "model_not_found", "The model `my secret prompt` does not exist")
    b.record("/v1/chat/completions", 429, "rate_limited", "key over its requests per minute")
    b.record("/v1/messages", 503, "worker_failed", "worker w-up failed mid-generation")
    b.record("/v1/chat/completions", 499, "client_closed", None)
    errors = b.snapshot()["errors"]
    assert [(e["status"], e["message"]) for e in errors] == [
        (503, "worker w-up failed mid-generation"), (429, "key over its requests per minute"), (404, None)]
    assert "secret" not in str(b.snapshot())
    assert b.counts == {"requests": 4, "ok": 0, "client_error": 2, "rate_limited": 1, "server_error": 1}
