"""The runtime_env of Pulse's Ray actors on the serving path (worker actors, gateway replicas, pipeline stages).

Ray starts its worker processes at nice 15 (its config `worker_niceness`, which each core worker reads from
RAY_worker_niceness when it starts), so that batch tasks yield the CPU to Ray's own daemons. Pulse's actors are
the serving path: the gateway replica's event loop, the worker's stream server, and the llama-server or engine
process a worker starts, which inherits its niceness. At nice 15 a process gets ~1/28 of the CPU share of a
nice-0 one, so on a busy box every hop of a request waits behind whatever else runs: on the 2-core box, beside
two busy loops, a gateway replica took minutes to start. Ray's own job supervisor opts out the same way
(ray/dashboard/modules/job/job_manager.py). Setting the variable for the actor, not in ray.init's system
config, works on a cluster that Pulse joins too, and needs no privilege (nothing is ever re-niced down).
"""
from __future__ import annotations

import os

SERVING_ENV = {"RAY_worker_niceness": "0"}

# Ray's own processes, for a local instance `pulse serve` starts (they inherit the driver's environment). The
# Serve controller reconciles every 0.1 s by default: idle, with one gateway replica and one worker, it used 2.6%
# of a core and the GCS, which it calls each round, 1.6% (the 2-core box; `python -m bench.idle_cpu`, BENCHMARKS).
# Pulse's deployments have a fixed replica count and no autoscaling, so a round a second is enough: a dead
# replica is still found by its health check (every 5 s) and replaced within a second of it. 0.7% and 0.6% then,
# which on a 2-core box running llama-server is CPU its decode threads get back. An explicit setting wins.
#
# The raylet also starts one idle Python worker per core (`ray::IDLE`) when the first driver connects, for tasks
# to start on without a process start. Pulse runs no tasks: its actors carry a runtime_env (SERVING_ENV), so
# Ray starts each its own process and never hands them an idle one, and the Serve controller is the only
# actor that took one. The rest stayed idle for the whole serve, each ~80 MiB resident and ~0.7% of a core
# (the 2-core box kept 1; a 16-core host ~15, about 1.2 GiB and a tenth of a core; bench/idle_cpu.py's
# `ray_idle_workers`). Ray starts a worker when one is needed either way.
CONTROL_PLANE_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1", "RAY_prestart_worker_first_driver": "0"}


def quiet_control_plane(environ=os.environ) -> None:
    """Set CONTROL_PLANE_ENV's defaults in `environ` (before ray.init starts the local instance)."""
    for k, v in CONTROL_PLANE_ENV.items():
        environ.setdefault(k, v)


def serving_runtime_env(env_vars: dict | None = None) -> dict:
    """A runtime_env that starts the actor at nice 0 (SERVING_ENV), with `env_vars` added."""
    return {"env_vars": {**SERVING_ENV, **(env_vars or {})}}
