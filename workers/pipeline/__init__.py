"""Pipeline-parallel serving: one engine's layers split across stage actors (one device each).

The parts, by file:
- build.py    the layer split (`--pipeline-stages N` or `stages: [{device, layers}]`), placing and wiring the
              stage actors, the pipelined Engine (the engine's scheduler, KV manager, sampler, speculation,
              grammars all stay in the driver: the worker actor)
- runner.py   PipelinedModel: the engine's model interface over the stages; micro-batches; PipelineStats;
              wiring the ring and rebuilding it after a lost stage
- overlap.py  OverlapEngine: cross-step pipelining, one step per group of sequences in the ring at once
- recovery.py a lost stage: fail or requeue its requests, rebuild the ring, drop the prefix cache
- stage.py    StageActor: a Ray actor owning a range of layers and their KV, serving a socket loop
- wire.py     the activation transport: length-prefixed msgpack header + raw arrays over TCP
- shm.py      same-host hops: the arrays through a shared-memory ring, the socket as doorbell
- cuda_ipc.py same-host hops between CUDA processes: the residual stream through a device ring (CUDA IPC)
- layers.py   the NumPy layer range and the driver's ends (embeddings, final norm, tied head)
- gpu.py      the same on a GPU, from the single-stage GPU model's kernels
docs/PIPELINE.md has the design, the measured per-token transfer cost, and the Thor + desktop plan.
"""
