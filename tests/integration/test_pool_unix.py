"""The pool reaches a worker on its own node over the worker's Unix socket, and one on another node over TCP
(gateway/pool.py open_stream, gateway/channel.py, workers/stream.py): real StreamServers with the load-test
backend, the real pool, no Ray (node ids are given)."""
from __future__ import annotations

import pytest

from gateway.pool import WorkerPool
from policy.config import PulseConfig
from workers.loadtest import LoadTestBackend
from workers.protocol import BackendError, GenerateRequest, WorkerInfo
from workers.stream import StreamServer

NOTHING_ON_TCP = "http://127.0.0.1:1"  # nothing listens: only the Unix socket can answer


async def _pool_with(node: str) -> tuple[StreamServer, WorkerPool]:
    config = PulseConfig.model_validate({"workers": {"backend": "loadtest", "loadtest": {"tokens": 3}}})
    srv = StreamServer(LoadTestBackend(config, worker_id="w0"), worker_id="w0", unix=True)
    await srv.start()
    info = WorkerInfo("w0", NOTHING_ON_TCP, "loadtest", node_id=node, secret=srv.secret, unix_path=srv.unix_path)

    async def discover(worker_id):
        return [info]

    pool = WorkerPool(discover, poll_interval_s=30)
    await pool.start()
    return srv, pool


async def test_a_worker_on_this_node_is_reached_over_its_unix_socket():
    srv, pool = await _pool_with(node="")  # outside Ray the pool's node id is "" too: the same node
    try:
        stream = await pool.open_stream(pool.workers["w0"], GenerateRequest("r", [1, 2], max_tokens=3))
        chunks = [c async for batch in stream.batches() for c in batch]
        stream.close()
        assert [c.text for c in chunks[:3]] == [" t0", " t1", " t2"] and chunks[-1].finish_reason == "length"
    finally:
        await pool.close()
        await srv.close()


async def test_a_worker_on_another_node_is_reached_over_tcp_only():
    srv, pool = await _pool_with(node="another-node")
    try:
        with pytest.raises(BackendError) as e:  # its TCP address has nothing behind it, and the path is not tried
            await pool.open_stream(pool.workers["w0"], GenerateRequest("r", [1, 2], max_tokens=3))
        assert e.value.status == 503 and e.value.code == "worker_unreachable"
        assert srv.backend.generated == 0
    finally:
        await pool.close()
        await srv.close()
