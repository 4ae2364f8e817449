"""The gateway's dispatch path without Ray or HTTP in front: real worker channels (StreamServer + the load-test
backend, on loopback), the real pool, router with an in-process index, admission gate, metrics and dispatcher."""
from __future__ import annotations

from opentelemetry import trace
from prometheus_client import CollectorRegistry

from cache.memory_index import MemoryPrefixIndex
from gateway.admission_gate import AdmissionGate
from gateway.dispatch import Dispatcher
from gateway.metrics import GatewayMetrics
from gateway.pool import WorkerPool
from gateway.router import PrefixRouter
from policy.config import PulseConfig
from workers.loadtest import LoadTestBackend
from workers.protocol import WorkerInfo
from workers.stream import StreamServer


async def start_dispatch(config: PulseConfig, n: int = 2, models: list[tuple[str, str]] | None = None):
    """(servers, pool, index, dispatcher) for `n` load-test workers w0, w1, ... The pool polls every 30 s: a test
    polls by hand (`pool.poll_once()`). `models`: per worker, (the model it holds, the model the gateway's view
    says it holds)."""
    servers, infos = [], []
    for i, (held, seen) in enumerate(models or [("", "")] * n):
        srv = StreamServer(LoadTestBackend(config, worker_id=f"w{i}"), worker_id=f"w{i}",
                           models=(held,) if held else ())
        infos.append(WorkerInfo(f"w{i}", await srv.start(), "loadtest", block_size=16, secret=srv.secret,
                                model=seen))
        servers.append(srv)

    async def discover(worker_id):
        return [i for i in infos if worker_id in (None, i.worker_id)]

    pool = WorkerPool(discover, poll_interval_s=30)
    await pool.start()
    index = MemoryPrefixIndex()
    dispatcher = Dispatcher(pool, PrefixRouter(index, config.routing), AdmissionGate(config.admission),
                            GatewayMetrics(CollectorRegistry()), trace.get_tracer("test"), context_length=32768,
                            index=index)
    return servers, pool, index, dispatcher


async def stop_dispatch(servers, pool) -> None:
    await pool.close()
    for s in servers:
        await s.close()
