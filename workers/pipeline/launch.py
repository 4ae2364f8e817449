"""Starting stage actors: as Ray actors (the serving path: Ray places them by `num_gpus` and custom
resources, on any node of the cluster) or as local processes (no Ray: a box without it, such as the GPU
benchmark machine). Both run the same StageActor; only who starts it differs. After `connect`, neither
is on the per-token path: that is the stages' own sockets.
"""
from __future__ import annotations

import multiprocessing as mp


class RayStages:
    def __init__(self, specs: list[dict], gpus: list[float], resources: dict | None = None):
        import ray

        from workers.pipeline.stage import StageActor

        self.actors = [ray.remote(StageActor).options(num_cpus=0, num_gpus=g, resources=dict(resources or {}))
                       .remote(**spec) for spec, g in zip(specs, gpus)]
        self.addresses = ray.get([a.address.remote() for a in self.actors])

    def connect(self, nexts: list[tuple[str, int]]) -> None:
        import ray

        ray.get([a.connect.remote(*nxt) for a, nxt in zip(self.actors, nexts)])

    def close(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)


def _stage_main(conn, spec: dict) -> None:
    from workers.pipeline.stage import StageActor

    stage = StageActor(**spec)
    conn.send(stage.address())
    stage.connect(*conn.recv())
    stage._thread.join()


class ProcessStages:
    def __init__(self, specs: list[dict]):
        ctx = mp.get_context("spawn")  # a fresh interpreter: no CUDA context or BLAS pool inherited
        self.procs, self.conns = [], []
        for spec in specs:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_stage_main, args=(child, spec), daemon=True)
            p.start()
            self.procs.append(p)
            self.conns.append(parent)
        self.addresses = [c.recv() for c in self.conns]

    def connect(self, nexts: list[tuple[str, int]]) -> None:
        for c, nxt in zip(self.conns, nexts):
            c.send(nxt)

    def close(self) -> None:
        for p in self.procs:
            p.join(timeout=10)  # the "stop" message already ended their loops
            if p.is_alive():
                p.terminate()
