"""The worker actor: owns one device, runs one Backend, serves its token stream.

Ray places it (num_gpus=1 on a GPU box), restarts it when it dies, and gives the gateway its address;
tokens go over the worker's own HTTP channel (workers/stream.py). `start()` is idempotent, so after a
restart the gateway simply calls it again to learn the new address.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket

from policy.config import PulseConfig
from policy.profiles import builtin_profiles, select_profile
from workers.blocklog import BlockLog
from workers.protocol import BackendStats, WorkerInfo
from workers.protocol.model import load_model_info
from workers.registry import backend_class
from workers.request_limits import RequestLimits
from workers.stream import StreamServer

log = logging.getLogger("pulse.worker")


def detect_device() -> tuple[str, str]:
    """('cuda', GPU name) when this process was given a GPU, else ('cpu', 'cpu')."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if visible and visible not in ("-1", "NoDevFiles"):
        try:
            import cupy

            props = cupy.cuda.runtime.getDeviceProperties(0)
            return "cuda", props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        except Exception as e:  # CuPy missing or no usable driver: serve on the CPU rather than not at all
            log.warning("GPU %s visible but not usable (%s); running on CPU", visible, e)
    return "cpu", "cpu"


def device_id(kind: str) -> str:
    """Which physical device this worker computes on, within its node: the GPU's UUID (a MIG slice reports
    its own), its PCI address where CuPy gives no UUID, the GPUs Ray gave it where CuPy is missing (a
    llama-server worker), "cpu" for the node's cores. The gateway charges workers that share one device
    each other's queued prefill (policy/routing.py)."""
    if kind == "cuda":
        try:
            import cupy

            props = cupy.cuda.runtime.getDeviceProperties(0)
            uuid = props.get("uuid")
            if isinstance(uuid, bytes) and len(uuid) != 16:
                # CuPy converts the UUID's char[16] as a C string: it stops at the first zero byte (the H200
                # test GPU's UUID has one at byte 7, which made a 7-byte id), so ask the driver for all 16
                uuid = _driver_uuid()
            if uuid:
                return "gpu-" + (uuid.hex() if isinstance(uuid, bytes) else str(uuid))
            return "pci-{:04x}:{:02x}:{:02x}".format(props.get("pciDomainID", 0), props.get("pciBusID", 0),
                                                     props.get("pciDeviceID", 0))
        except Exception:
            pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if visible and visible not in ("-1", "NoDevFiles"):
        return "cuda-visible-" + visible
    return "cpu"


def _driver_uuid() -> bytes | None:
    """The current CUDA device's 16-byte UUID from the driver API (cuDeviceGetUuid; a MIG slice's own under
    _v2), or None where the driver library or the call is not there."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev, raw = ctypes.c_int(), ctypes.create_string_buffer(16)
    get_uuid = getattr(cuda, "cuDeviceGetUuid_v2", None) or getattr(cuda, "cuDeviceGetUuid", None)
    if get_uuid is None or cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), 0) != 0:
        return None
    return raw.raw[:16] if get_uuid(raw, dev) == 0 else None


def advertised_host(bind: str) -> str:
    """The address other nodes reach this worker at, which it binds: a wildcard becomes the node's IP."""
    if bind not in ("0.0.0.0", "::"):
        return bind
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return socket.gethostbyname(socket.gethostname())


class WorkerActor:
    def __init__(self, config_json: str, worker_id: str, bind_host: str = "127.0.0.1"):
        self.config = PulseConfig.model_validate_json(config_json)
        self.worker_id = worker_id
        self.bind_host = bind_host
        self.backend = None
        self.server: StreamServer | None = None
        self.info_: WorkerInfo | None = None
        self.block_log = BlockLog()
        self.publisher = None  # with a Redis URL: cache.publisher.BlockPublisher
        self._lock = asyncio.Lock()

    async def start(self) -> WorkerInfo:
        async with self._lock:
            if self.info_ is not None:
                return self.info_
            kind, device_name = detect_device()
            profile = select_profile(device_name, builtin_profiles(), self.config.workers.device_profile)
            model = load_model_info(self.config.model.path)
            if self.config.workers.backend is None:  # the backend the device's profile measured fastest
                self.config.workers.backend = profile.default_backend
            cls = backend_class(self.config.workers.backend)
            sink = await self._block_sink()
            self.backend = cls(self.config, profile, model, block_sink=sink, worker_id=self.worker_id)
            await self.backend.start()
            if self.publisher is not None:
                await self.publisher.start()
            from workers.protocol import telemetry as tm
            from workers.protocol.spans import QuietTracer

            provider = tm.setup_tracing(self.config.telemetry, role="worker")
            ctx = self.config.model.context_length or min(model.context_length, profile.context_length)
            srv = self.config.server
            limits = RequestLimits(context_length=ctx, vocab_size=model.vocab_size,
                                   max_stop_strings=srv.max_stop_strings, max_stop_length=srv.max_stop_length)
            # "all interfaces" means the node's own address (where other nodes reach it), not every one
            self.server = StreamServer(self.backend, host=advertised_host(self.bind_host), worker_id=self.worker_id,
                                       tracer=QuietTracer(provider.get_tracer("pulse.worker")), limits=limits,
                                       block_log=None if self.publisher else self.block_log,
                                       models=tuple(self.config.model.ids))
            url = await self.server.start()
            stats = self.backend.stats()
            # the channel secret reaches gateways only through Ray (this return value), never the network
            self.info_ = WorkerInfo(worker_id=self.worker_id, url=url, backend=self.config.workers.backend,
                                    model=self.config.model.name,
                                    node_id=_node_id(), device=device_name, device_id=device_id(kind),
                                    block_size=stats.block_size, prefix_seed=model.chain_root.hash,
                                    context_length=ctx, secret=self.server.secret)
            log.info("worker %s ready at %s (%s, profile %s)", self.worker_id, url, device_name, profile.name)
            return self.info_

    async def _block_sink(self):
        """Where KV block events go: Redis (many gateways) or the log gateways pull (single box).

        Engines call the sink from their own thread; the publisher wants the event loop's thread.
        """
        if not self.config.redis.url:
            return self.block_log.add
        from cache.publisher import BlockPublisher
        from cache.redis_index import RedisPrefixIndex

        loop = asyncio.get_running_loop()
        index = RedisPrefixIndex.from_config(self.config.redis, ttl_s=self.config.routing.block_ttl_s,
                                             on_recovered=lambda: self.publisher.request_refill())
        try:
            await index.connect()
        except Exception as e:  # Redis down at start: the publisher retries and snapshots when it is back
            log.warning("prefix index unavailable at start: %s", e)
        self.publisher = BlockPublisher(index, self.worker_id, current_blocks=self._current_blocks,
                                        snapshot_every_s=self.config.routing.block_ttl_s / 3)
        return lambda event: loop.call_soon_threadsafe(self.publisher.sink, event)

    def _current_blocks(self) -> dict:
        blocks = getattr(self.backend, "cached_blocks", None)
        return blocks() if callable(blocks) else {}

    async def info(self) -> WorkerInfo | None:
        return self.info_

    async def stats(self) -> BackendStats:
        return self.backend.stats() if self.backend else BackendStats(healthy=False)

    async def drain(self) -> None:
        """Refuse new generations (503); in-flight ones run on."""
        if self.server:
            self.server.draining = True

    async def close(self) -> None:
        if self.publisher is not None:
            await self.publisher.close(drop=True)
        if self.server:
            await self.server.close()
        if self.backend:
            await self.backend.close()
        self.info_ = None


def _node_id() -> str:
    try:
        import ray

        if not ray.is_initialized():  # run outside Ray (a test, by hand): asking would start a Ray instance
            return ""
        return ray.get_runtime_context().get_node_id()
    except Exception:
        return ""
