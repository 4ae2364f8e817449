"""Starting stage actors: as Ray actors (the serving path: Ray places them by `num_gpus` and custom
resources, on any node of the cluster) or as local processes (no Ray: a box without it, such as the GPU
benchmark machine). Both run the same StageActor; only who starts it differs. After `connect`, neither
is on the per-token path: that is the stages' own sockets.

A stage that dies comes back through `revive`: Ray restarts a dead actor itself (`max_restarts`: its
__init__ runs again and reloads its layers), a dead process is started again here; the survivors keep
their weights. `revive` returns once every stage is up again, with the addresses to wire the ring anew.
"""
from __future__ import annotations

import os

import multiprocessing as mp
import time

from workers.pipeline.shm import remove_rings

STAGE_RESTARTS = 8  # per stage actor: enough for a flaky box, bounded so a stage that cannot start gives up
REVIVE_TIMEOUT_S = 300.0  # a restarted stage reloads its layers: minutes for a large model on a slow disk


class RayStages:
    def __init__(self, specs: list[dict], gpus: list[float], resources: dict | None = None):
        import ray

        from workers.pipeline.stage import StageActor
        from workers.ray_env import serving_runtime_env

        # max_task_retries: a call that reached a stage as it died runs again on the restarted one (every
        # method the driver calls is safe to repeat)
        self.actors = [ray.remote(StageActor).options(num_cpus=0, num_gpus=g, resources=dict(resources or {}),
                                                      max_restarts=STAGE_RESTARTS, max_task_retries=2,
                                                      runtime_env=serving_runtime_env())
                       .remote(**spec) for spec, g in zip(specs, gpus)]
        self.addresses = ray.get([a.address.remote() for a in self.actors])

    def pids(self) -> list[int]:
        import ray

        return ray.get([a.pid.remote() for a in self.actors])

    def revive(self) -> list[int]:
        """Wait until every stage answers (Ray restarts the dead); the indexes of the restarted ones."""
        import ray

        before = getattr(self, "_pids", None)
        self._pids = ray.get([a.pid.remote() for a in self.actors], timeout=REVIVE_TIMEOUT_S)
        self.addresses = ray.get([a.address.remote() for a in self.actors], timeout=REVIVE_TIMEOUT_S)
        restarted = [i for i, p in enumerate(self._pids) if before is not None and before[i] != p]
        remove_rings(before[i] for i in restarted)
        return restarted

    def connect(self, nexts: list[tuple[str, int]], shm: bool = False, ipc: list[dict] | None = None) -> None:
        """`ipc`: per stage, its CUDA IPC ends (StageActor.connect); None: none."""
        import ray

        ipc = ipc or [None] * len(nexts)
        ray.get([a.connect.remote(*nxt, shm, i) for a, nxt, i in zip(self.actors, nexts, ipc)],
                timeout=REVIVE_TIMEOUT_S)
        if getattr(self, "_pids", None) is None:
            self._pids = self.pids()  # what `revive` compares against to tell the restarted stages

    def close(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)  # no_restart: a stage ended on purpose stays ended
        remove_rings(getattr(self, "_pids", None) or [])  # a killed actor leaves its ring behind


def _stage_main(conn, spec: dict) -> None:
    import os

    gpu = spec.pop("visible_gpu", None)
    if gpu is not None:  # before CuPy loads in this fresh interpreter: the stage sees only its own GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    from workers.pipeline.stage import StageActor

    stage = StageActor(**spec)
    conn.send((stage.address(), stage.pid()))
    # each message is where to connect: the first wiring, then one per rebuilt ring; None ends the process
    while (nxt := conn.recv()) is not None:
        stage.connect(*nxt)  # (host, port, shm, ipc)
        conn.send(True)


class ProcessStages:
    def __init__(self, specs: list[dict]):
        # PULSE_STAGE_GPUS="0,1": stage i runs on GPU i of the list (plain processes have no Ray to place
        # them); unset, every stage uses the process's default GPU
        gpus = [g for g in os.environ.get("PULSE_STAGE_GPUS", "").split(",") if g.strip()]
        self.specs = [dict(s, visible_gpu=gpus[i % len(gpus)].strip()) if gpus and s["device"] != "cpu" else s
                      for i, s in enumerate(specs)]
        n = len(specs)
        self.procs, self.conns, self.addresses, self._pids = [None] * n, [None] * n, [None] * n, [None] * n
        for i in range(len(specs)):
            self._spawn(i)
        self._collect(range(len(specs)))

    def _spawn(self, i: int) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: no CUDA context or BLAS pool inherited
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_stage_main, args=(child, self.specs[i]), daemon=True)
        p.start()
        self.procs[i], self.conns[i] = p, parent

    def _collect(self, which) -> None:
        for i in which:  # each started stage reports once it holds its weights and listens
            self.addresses[i], self._pids[i] = self.conns[i].recv()

    def pids(self) -> list[int]:
        return list(self._pids)

    def revive(self) -> list[int]:
        """Start again every stage process that died; the indexes of the restarted ones."""
        deadline = time.monotonic() + 2.0  # a killed process's sockets close a moment before it can be reaped
        while all(p.is_alive() for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.02)
        dead = [i for i, p in enumerate(self.procs) if not p.is_alive()]
        remove_rings(self._pids[i] for i in dead)
        for i in dead:
            self.procs[i].join()
            self.conns[i].close()
            self._spawn(i)
        self._collect(dead)
        return dead

    def connect(self, nexts: list[tuple[str, int]], shm: bool = False, ipc: list[dict] | None = None) -> None:
        for c, nxt, i in zip(self.conns, nexts, ipc or [None] * len(nexts)):
            c.send((*nxt, shm, i))
        for c in self.conns:
            if not c.poll(REVIVE_TIMEOUT_S):
                raise TimeoutError("a pipeline stage did not connect")
            c.recv()

    def close(self) -> None:
        for c, p in zip(self.conns, self.procs):
            try:
                c.send(None)  # the "stop" message already ended their loops; this ends the processes
            except OSError:
                pass
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        remove_rings(self._pids)
