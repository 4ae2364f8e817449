"""The Pulse application for Ray Serve's own tools: `serve run deploy/serve_config.yaml`, `serve deploy`,
and KubeRay's RayService. Same parts as `pulse serve`: a deployment that owns the worker actors (they
live and die with it) and the gateway ingress, which serves HTTP itself on server.host:server.port.

Config: the YAML file named by PULSE_CONFIG, then PULSE_<SECTION>__<FIELD> variables.
"""
from __future__ import annotations

import asyncio
import os

import ray
from ray import serve

from gateway.ingress import GatewayIngress
from policy.config import PulseConfig
from pulse.config import load_config
from pulse.serve import gateway_replicas, start_workers
from workers.protocol import WorkerInfo
from workers.ray_env import serving_runtime_env


@serve.deployment(ray_actor_options={"num_cpus": 0}, num_replicas=1, health_check_period_s=10)
class WorkerSupervisor:
    """Starts one worker actor per device (placed by Ray) and tells gateways where they listen."""

    async def __init__(self, config_json: str):
        config = PulseConfig.model_validate_json(config_json)
        gpus = ray.cluster_resources().get("GPU", 0)
        self.actors, self.names = start_workers(config, gpus, reuse=True, one_box=False)  # Ray places them
        self.by_name = dict(zip(self.names, self.actors))
        await asyncio.gather(*(a.start.remote() for a in self.actors))

    async def discover(self, worker_id: str | None = None) -> list[WorkerInfo]:
        names = self.names if worker_id is None else [worker_id]
        return list(await asyncio.gather(*(self.by_name[n].start.remote() for n in names)))

    async def __del__(self):
        for a in getattr(self, "actors", []):
            try:
                await a.close.remote()
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass


def build_app(config: PulseConfig):
    config.server.gateway_replicas = gateway_replicas(config)  # the replicas read it (gateway/ingress.py)
    cfg = config.model_dump_json()
    # the gateway stays on the head node, where clients (and KubeRay's gateway Service) find it
    head = {"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}, "runtime_env": serving_runtime_env()}
    return GatewayIngress.options(num_replicas=gateway_replicas(config), ray_actor_options=head).bind(
        cfg, None, WorkerSupervisor.bind(cfg))


app = build_app(load_config(os.environ.get("PULSE_CONFIG")))
