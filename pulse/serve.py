"""`pulse serve`: start (or join) Ray, start one worker actor per device, deploy the gateway, wait for a signal.

Ctrl-C / SIGTERM drains: workers refuse new requests (503), in-flight streams get `drain_grace_s` to
finish, then everything this command started is stopped (the gateway, the workers and any llama-server
they run, and the local Ray instance), leaving no processes behind.
"""
from __future__ import annotations

import atexit
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request

from policy.config import PulseConfig
from workers.ray_env import quiet_control_plane, serving_runtime_env

log = logging.getLogger("pulse.serve")
NAMESPACE = "pulse"


def worker_count(config: PulseConfig, gpus: float) -> int:
    return config.workers.count or max(1, int(gpus))


def gateway_replicas(config: PulseConfig, cores: int | None = None) -> int:
    """The configured gateway replicas, else one per four of the box's cores, from 1 to 8.

    A replica is one event loop: it uses at most one core, and at 32 streams it is the first thing to
    saturate. The other three quarters go to what shares the box: the workers (the engine's scheduler
    thread, llama-server's threads) and Ray (GCS, raylet, Serve's controller). Past 8, every replica's
    poll of every worker costs more than another loop brings. A 2-core box keeps one replica."""
    if config.server.gateway_replicas:
        return config.server.gateway_replicas
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores // 4, 8))


def gpu_share(workers: int, gpus: float) -> float:
    """The GPU fraction each worker reserves: one GPU each when there are enough; else workers share GPUs
    evenly (4 workers on 1 GPU take 0.25 each), so Ray still places each on a GPU and sets its
    CUDA_VISIBLE_DEVICES. The share is 1 / ceil(workers per GPU), so whole groups fit on every GPU (3 workers
    on 2 GPUs take 0.5: a share of 2/3 would leave the third unplaceable)."""
    if gpus <= 0:
        return 0
    if gpus >= workers:
        return 1
    return 1 / math.ceil(workers / int(gpus)) if gpus >= 1 else gpus / workers


def model_groups(config: PulseConfig, gpus: float, one_box: bool = True) -> list[tuple[PulseConfig, int]]:
    """Each served model's worker config and its number of workers. On one box (`pulse serve` without
    `server.ray_address`) every worker is told how many share its cores (`workers.box_workers`, unless set): two
    models' llama-servers on a 4-core CPU box take 2 threads each, not 4 each (on a 2-core box, two threads each
    spun against each other: Gemma's decoded at 122-495 ms a token against ~28 ms with one; BENCHMARKS.md)."""
    groups = [(config.for_model(m), m.workers or worker_count(config, gpus)) for m in config.models]
    if one_box and config.server.ray_address is None:
        for cfg, _ in groups:
            cfg.workers.box_workers = cfg.workers.box_workers or sum(n for _, n in groups)
    return groups


def start_workers(config: PulseConfig, gpus: float, *, reuse: bool = False,
                  one_box: bool = True) -> tuple[list, list[str]]:
    """One group of worker actors per served model (each worker holds one model, with its own config);
    all of them share the box's GPUs evenly (gpu_share). `one_box`: they all run on this box (model_groups)."""
    import ray

    from workers.actor import WorkerActor

    groups = model_groups(config, gpus, one_box)
    per_worker_gpu = gpu_share(sum(n for _, n in groups), gpus)
    bind = "127.0.0.1" if config.server.ray_address is None else "0.0.0.0"
    cls = ray.remote(WorkerActor)
    actors, names = [], []
    for cfg, n in groups:
        share, engine = per_worker_gpu, cfg.workers.engine
        if share and cfg.workers.backend == "cupy" and (engine.pipeline_stages > 1 or engine.stages):
            share = 0.01  # the driver keeps embeddings + head; its stage actors reserve the GPUs (workers/pipeline)
        cfg_json = cfg.model_dump_json()
        for _ in range(n):
            name = f"pulse-worker-{len(names)}"
            names.append(name)
            actors.append(cls.options(name=name, namespace=NAMESPACE, num_cpus=0, num_gpus=share,
                                      resources=dict(config.workers.resources), max_restarts=config.workers.restart_max,
                                      max_concurrency=10_000, get_if_exists=reuse,
                                      runtime_env=serving_runtime_env()).remote(cfg_json, name, bind))
    return actors, names


def wait_healthy(url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.25)
    return False


def start_ray(config: PulseConfig) -> None:
    """Start the local Ray instance (or join `server.ray_address`)."""
    import ray

    if not config.server.ray_address:
        quiet_control_plane()  # the local instance's Serve controller (workers/ray_env.py)
    # "local": with no address, ray.init would join any cluster a `ray start` on this box left in
    # /tmp/ray/ray_current_cluster (even a dead one) instead of starting our own instance
    ray.init(address=config.server.ray_address or "local", include_dashboard=config.server.ray_dashboard,
             namespace=NAMESPACE, logging_level=logging.WARNING, configure_logging=False)


def deploy_gateway(config: PulseConfig, names: list[str]) -> str:
    """Deploy the gateway's replicas (Serve's proxy disabled: each serves the port itself) in front of the
    named worker actors; returns the base URL clients reach them at."""
    from ray import serve

    from gateway.ingress import GatewayIngress

    serve.start(proxy_location="Disabled")
    replicas = config.server.gateway_replicas = gateway_replicas(config)  # the replicas read it (ingress)
    actor_options: dict = {"num_cpus": 0, "runtime_env": serving_runtime_env()}
    if config.server.ray_address is not None:
        # in a cluster the gateway stays on the head node, where clients find it
        actor_options["resources"] = {"node:__internal_head__": 0.001}
    if replicas > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # one /metrics for the node: every replica writes its series where any replica's scrape sums them
        metrics_dir = tempfile.mkdtemp(prefix="pulse-metrics-")
        atexit.register(shutil.rmtree, metrics_dir, True)
        actor_options["runtime_env"] = serving_runtime_env({"PROMETHEUS_MULTIPROC_DIR": metrics_dir})
    app = GatewayIngress.options(num_replicas=replicas, ray_actor_options=actor_options).bind(
        config.model_dump_json(), names)
    serve.run(app, name="pulse", route_prefix=None, blocking=False)
    host = "127.0.0.1" if config.server.host in ("0.0.0.0", "::") else config.server.host
    return f"http://{host}:{config.server.port}"


def serve_main(config: PulseConfig) -> int:
    import ray

    from workers.protocol.model import derive_apart, load_model_info

    for model in config.models:
        print(f"pulse: preparing model {model.name} ({model.path or 'bundled Gemma 3 270M'})", flush=True)
        try:  # derived once, in a child process, so workers and gateways read the cache
            derive_apart(model.path)
        except ValueError as e:
            print(f"pulse: model {model.name}: {e}", file=sys.stderr, flush=True)
            return 2
        info = load_model_info(model.path)
        if config.for_model(model).workers.backend == "cupy":
            from workers.cupy.models import check_architecture

            try:  # here, before Ray starts, rather than as a worker failing inside it
                check_architecture(info.architecture)
            except ValueError as e:
                print(f"pulse: model {model.name}: {e}", file=sys.stderr, flush=True)
                return 2

    start_ray(config)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs handlers of its own
        signal.signal(sig, lambda *_: stop.set())
    actors: list = []
    try:
        gpus = ray.cluster_resources().get("GPU", 0)
        actors, names = start_workers(config, gpus)
        infos = ray.get([a.start.remote() for a in actors])
        for info in infos:
            print(f"pulse: worker {info.worker_id} ready ({info.model}: {info.backend} on {info.device})", flush=True)
        base = deploy_gateway(config, names)
        if not wait_healthy(base + "/health", 120):
            print("pulse: the gateway did not become healthy within 120 s", flush=True)
            return 1
        served = ", ".join(m.name for m in config.models)
        backends = ", ".join(sorted({info.backend for info in infos}))
        print(f"pulse: serving {served} at {base}/v1  ({len(actors)} worker(s), backend {backends}); "
              "Ctrl-C stops", flush=True)
        print(f"pulse: {_auth_mode(config)}", flush=True)
        while not stop.wait(0.5):
            pass
        print("pulse: stopping (draining in-flight requests)", flush=True)
        _drain(actors, config.server.drain_grace_s)
        return 0
    finally:
        _shutdown(actors)


def _auth_mode(config: PulseConfig) -> str:
    """One line on who may call: keyed, or open on loopback only (the single-box default)."""
    import asyncio

    from gateway.auth import KeyAuth
    from gateway.keys import open_key_store
    from gateway.quota import open_quota

    async def mode() -> str:
        auth = KeyAuth(open_key_store(config), open_quota(config), host=config.server.host,
                       open_when_empty=config.keys.open_when_empty)
        try:
            return await auth.start()
        finally:
            await auth.close()

    try:
        return asyncio.run(mode())
    except Exception as e:  # the key store unreachable: the gateway fails closed and says so per request
        return f"key store unreachable at start ({e}); requests without a known key are refused"


def _drain(actors: list, grace_s: float) -> None:
    import ray

    try:
        ray.get([a.drain.remote() for a in actors], timeout=5)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            running = sum(s.running + s.waiting for s in ray.get([a.stats.remote() for a in actors], timeout=5))
            if running == 0:
                return
            time.sleep(0.2)
    except Exception as e:  # a worker already gone has nothing to drain
        log.info("drain: %s", e)


def _shutdown(actors: list) -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    except Exception as e:
        log.info("serve shutdown: %s", e)
    try:
        ray.get([a.close.remote() for a in actors], timeout=15)
    except Exception as e:
        log.info("worker close: %s", e)
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:
            pass
    ray.shutdown()
