"""The driver's side of the pipeline: a model object with the engine's model interface (`xp`,
`kv_storage`, `forward(batch, kv)`) whose layers run in stage actors.

The engine (scheduler, block manager with prefix reuse, sampler, speculation, grammars) stays in the
driver unchanged: a step's batch is cut into micro-batches by sequence, each micro-batch's embeddings go
into the first stage, and while stage 2 runs micro-batch 1, stage 1 already runs micro-batch 2. The last
stage returns only the rows whose logits are wanted; the head runs once for the whole step. Gemma ties
its head to the embedding table, so the driver holds the one copy both ends use and logits never cross
a link: each hop carries the residual stream (hidden x 4 bytes a token) and the step's metadata.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from workers.cupy.batch import StepBatch
from workers.pipeline import cuda_ipc, wire
from workers.pipeline.cuda_ipc import IpcIn, IpcOut
from workers.pipeline.shm import ShmReader, ShmRing


@dataclass
class PipelineStats:
    """Cumulative; `transfer_s` is the time spent moving activations (send + receive at every hop, the
    driver's included), so transfer_s / tokens is the per-token transfer cost the docs' link plan uses."""

    transport: str = ""
    stages: int = 0
    micro_batches: int = 0
    steps: int = 0
    tokens: int = 0
    bytes: int = 0
    transfer_s: float = 0.0
    embed_s: float = 0.0  # the driver's own compute: embeddings in, head out
    head_s: float = 0.0
    stage_compute_s: list[float] = field(default_factory=list)
    rebuilds: int = 0  # rings rebuilt after a lost stage (recovery.py)
    messages: int = 0  # micro-batch results back from the last stage
    ipc_hops: int = 0  # hops those messages' activations made through CUDA IPC (cuda_ipc.py) ...
    ipc_fallbacks: int = 0  # ... and through host memory on a CUDA IPC hop (its ring full or unusable)

    def as_dict(self) -> dict:
        t = max(self.tokens, 1)
        return {**self.__dict__, "bytes_per_token": self.bytes / t, "transfer_us_per_token": 1e6 * self.transfer_s / t}


class PipelineKV:
    """What the engine holds as its KV storage: the K/V arrays live in the stages, one slice per stage."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size


def split_batch(batch: StepBatch, parts: int) -> list[tuple[np.ndarray, dict]]:
    """Contiguous groups of sequences with about equal token counts: (token ids, the stage arrays)."""
    meta, qs = batch.meta, batch.meta.query_start
    n_seq = qs.size - 1
    parts = max(1, min(parts, n_seq))
    # cut where the cumulative token count crosses each 1/parts of the total
    cuts = np.searchsorted(qs[1:], [qs[-1] * p / parts for p in range(1, parts)], side="left") + 1
    bounds = sorted({0, n_seq, *[int(c) for c in cuts if 0 < c < n_seq]})
    li = np.asarray(batch.logits_indices)
    out = []
    for b0, b1 in zip(bounds, bounds[1:]):
        r0, r1 = int(qs[b0]), int(qs[b1])
        rows = li[(li >= r0) & (li < r1)] - r0
        arrays = {
            "positions": np.asarray(batch.positions)[r0:r1], "slot_mapping": np.asarray(batch.slot_mapping)[r0:r1],
            "logits_indices": rows.astype(np.int64), "query_start": (qs[b0 : b1 + 1] - r0).astype(np.int32),
            "seq_lens": meta.seq_lens[b0:b1], "block_tables": meta.block_tables[b0:b1],
        }
        if batch.local_meta is not None:  # the sliding-window layers' own pool (workers/cupy/kv_cache.py)
            arrays["local_slot_mapping"] = np.asarray(batch.local_slot_mapping)[r0:r1]
            arrays["local_block_tables"] = batch.local_meta.block_tables[b0:b1]
        out.append((np.asarray(batch.token_ids)[r0:r1], arrays))
    return out


class StageLost(RuntimeError):
    """A stage's socket closed or broke mid-step: the stage (or its process) died. The driver's recovery
    (workers/pipeline/recovery.py) brings it back; its KV, and so every cached block, is gone."""


class PipelinedModel:
    xp = np  # step inputs are built on the host; they travel to the stages from there

    def __init__(self, ends, n_stages: int, transport: str, micro_batches: int, bind_host: str = "127.0.0.1",
                 driver_host: str | None = None, ipc_hops: list[bool] | None = None, ring: tuple[int, int] = (0, 0),
                 ipc: bool = False):
        """`transport`: "shm", "tcp-loopback" or "tcp" (build.transport_name). `ipc_hops`: per hop of the ring
        (driver -> stage 0, ..., last stage -> driver), whether it may move activations through CUDA IPC
        (cuda_ipc.plan_hops); `ring`: (slots, slot bytes) of each such hop's device ring; `ipc`: use them."""
        self.ends, self.micro_batches = ends, micro_batches
        self.stats = PipelineStats(transport=transport, stages=n_stages, micro_batches=micro_batches,
                                   stage_compute_s=[0.0] * n_stages)
        self._server = wire.listener(bind_host)
        self._driver_host = driver_host or bind_host
        self._outbox: queue.SimpleQueue | None = None
        self._inflight: deque[tuple[int, int]] = deque()  # per launched step: (messages to read, tokens)
        self._alloc: tuple | None = None
        self.up = self.down = None
        self.shm = transport == "shm"
        self._base = transport
        self.ipc_hops = list(ipc_hops or [False] * (n_stages + 1))
        self.ring, self.ipc = ring, ipc and any(self.ipc_hops)
        self._reader: ShmReader | None = None
        self._ipc_in: IpcIn | None = None
        self._ipc_out: IpcOut | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self._server.getsockname()

    def wire(self, stages, shm: bool | None = None, ipc: bool | None = None) -> None:
        """Close the ring: each stage connects to the next, the last to the driver; the driver to the first.
        `shm`: every hop on this host, arrays through shared memory (shm.py); `ipc`: the hops that can, the
        residual stream device to device (cuda_ipc.py); None: as before."""
        if shm is not None:
            self.shm = shm
            self._base = "shm" if shm else "tcp-loopback"
        if ipc is not None:
            self.ipc = ipc and any(self.ipc_hops)
        hops = self.ipc_hops if self.ipc else [False] * len(self.ipc_hops)
        self.stats.transport = cuda_ipc.label(hops, self._base)
        nexts = list(stages.addresses[1:]) + [(self._driver_host, self.address[1])]
        if any(hops):  # each stage: a ring for its incoming hop, an IPC sender for its outgoing one
            stages.connect(nexts, self.shm, [{"in": self.ring if hops[i] else None, "out": hops[i + 1]}
                                             for i in range(len(nexts))])
        else:
            stages.connect(nexts, self.shm)
        self.up = wire.connect(*stages.addresses[0])
        self.down, _ = self._server.accept()
        wire.tune(self.down)
        self._reader = ShmReader()
        self._ipc_in = IpcIn(self.down, *self.ring) if hops[-1] else None
        self.ends.device_out = hops[0]  # GpuEnds: embeddings stay on the device for the IPC hop
        # sends run in their own thread, so a step's later micro-batches never wait behind a full socket
        # while the driver is not yet reading the first one's result
        self._outbox = queue.SimpleQueue()
        threading.Thread(target=self._send_loop, args=(self._outbox, self.up, ShmRing() if self.shm else None),
                         name="pipeline-send", daemon=True).start()
        # the IPC copy is launched from the engine's thread, on the stream the embeddings were computed on
        self._ipc_out = IpcOut(self.up) if hops[0] else None

    def rewire(self, stages, shm: bool, ipc: bool = False) -> None:
        """Wire the same stages again over another transport (the bench compares them; KV is kept)."""
        self._disconnect()
        self.wire(stages, shm, ipc)

    @property
    def mode(self) -> str:
        """"ipc", "shm" or "tcp": what the bench asks `rewire` for."""
        return "ipc" if self.ipc else "shm" if self.shm else "tcp"

    def rebuild(self, stages) -> list[int]:
        """After a StageLost: tear the ring down (every survivor's loop ends), bring the stages back (the
        dead restarted), wire the ring again and allocate KV anew, empty. Returns the restarted stages."""
        self._disconnect()
        restarted = stages.revive()
        self.wire(stages)
        self.stats.rebuilds += 1
        if self._alloc is not None:
            self.kv_storage(*self._alloc)
        return restarted

    def _disconnect(self) -> None:
        if self._outbox is not None:
            self._outbox.put(None)
        for s in (self.up, self.down):
            if s is not None:
                s.close()
        if self._reader is not None:
            self._reader.close()
        for end in (self._ipc_in, self._ipc_out):
            if end is not None:
                end.close()
        self.up = self.down = self._outbox = self._reader = self._ipc_in = self._ipc_out = None
        self._inflight.clear()

    def _send_loop(self, outbox: queue.SimpleQueue, sock, ring: ShmRing | None) -> None:
        try:
            while (item := outbox.get()) is not None:
                header, arrays = item
                t0 = time.perf_counter()
                self.stats.bytes += wire.send(sock, header, arrays, ring)
                self.stats.transfer_s += time.perf_counter() - t0
        except OSError:  # the first stage is gone; the receive side sees the loss and raises StageLost
            pass
        finally:
            if ring is not None:  # the ring is this thread's: closed only once nothing writes to it
                ring.close()

    # --- the engine's model interface --------------------------------------------------------------
    @property
    def last_logits(self):  # GpuSampler: the argmax the head kernel took belongs to these logits
        return getattr(self.ends, "last_logits", None)

    @property
    def last_chosen(self):
        return getattr(self.ends, "last_chosen", None)

    def kv_storage(self, num_blocks: int, block_size: int, dtype: str | None = None, max_seqs: int = 0,
                   num_local: int | None = None) -> PipelineKV:
        """Each stage allocates K/V for its layers (`num_local`: its sliding-window layers' own pool, as in
        kv_cache.plan_pools); `max_seqs` sizes the GPU stages' decode graphs."""
        self._alloc = (num_blocks, block_size, dtype, max_seqs, num_local)
        self._outbox.put(({"kind": "alloc", "num_blocks": num_blocks, "block_size": block_size,
                           "max_seqs": max_seqs, "num_local": num_local}, {}))
        self._receive()
        self._reader.release()
        return PipelineKV(num_blocks, block_size)

    def forward(self, batch: StepBatch, kv: PipelineKV):
        self.launch(batch, kv)
        return self.collect()

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def launch(self, batch: StepBatch, kv: PipelineKV, parts: int | None = None) -> None:
        """Send a step into the ring (cut into `parts` micro-batches, default `micro_batches`) and return at
        once; `collect` returns the logits of the steps launched, in launch order."""
        cut = split_batch(batch, parts or self.micro_batches)
        for mb, (tokens, arrays) in enumerate(cut):
            t0 = time.perf_counter()
            x = self.ends.embed_tokens(tokens)
            self.stats.embed_s += time.perf_counter() - t0
            self._outbox.put(self._pack({"kind": "run", "mb": mb, "block_size": kv.block_size}, {**arrays, "x": x}))
        self._inflight.append((len(cut), batch.num_tokens))

    def _pack(self, header: dict, arrays: dict) -> tuple[dict, dict]:
        """On a CUDA IPC first hop: the embeddings into stage 0's device ring (cuda_ipc.IpcOut.pack)."""
        if self._ipc_out is None:
            return header, arrays
        t0 = time.perf_counter()
        try:
            header, arrays, moved = self._ipc_out.pack(header, arrays)
        except OSError as exc:
            raise StageLost(f"a pipeline stage was lost: {exc}") from exc
        self.stats.bytes += moved
        self.stats.transfer_s += time.perf_counter() - t0
        return header, arrays

    def collect(self):
        """The logits of the oldest launched step (all its micro-batches read even when one failed, so the
        ring stays in step with the driver)."""
        n, tokens = self._inflight.popleft()
        rows, error = [], None
        for _ in range(n):
            try:
                rows.append(self._receive()["x"])
            except StageLost:
                raise
            except RuntimeError as exc:
                error = error or exc
        try:
            if error is not None:
                raise error
            self.stats.steps += 1
            self.stats.tokens += tokens
            t0 = time.perf_counter()
            logits = self.ends.head(_concat(rows))
            if hasattr(self.ends, "synchronize"):  # a GPU head: count its kernels, not just their launches
                self.ends.synchronize()
            self.stats.head_s += time.perf_counter() - t0
        finally:
            self._reader.release()  # the rows were read in place from the last stage's ring
        return logits

    def drain(self) -> None:
        """Read and drop every launched step's result (after a failure, before the engine goes on)."""
        while self._inflight:
            try:
                self.collect()
            except StageLost:
                raise
            except RuntimeError:
                pass

    def _receive(self) -> dict:
        try:
            header, arrays, n, recv_s = cuda_ipc.recv(self.down, self._reader, self._ipc_in)
        except OSError as exc:  # ConnectionError included: a stage (or its process) is gone
            raise StageLost(f"a pipeline stage was lost: {exc}") from exc
        self.stats.bytes += n
        if header["kind"] == "error":
            raise RuntimeError(header["message"])
        if header["kind"] == "run":
            self.stats.messages += 1
            self.stats.ipc_hops += header.get("ipc_n", 0)
            self.stats.ipc_fallbacks += header.get("ipc_fb", 0)
        for i, s in enumerate(header.get("compute_s", [])):
            self.stats.stage_compute_s[i] += s
        self.stats.transfer_s += header.get("hop_s", 0.0) + recv_s
        return arrays

    def close(self) -> None:
        if self._outbox is not None:
            self._outbox.put(({"kind": "stop"}, {}))
            try:
                wire.recv(self.down)
            except OSError:
                pass
        self._disconnect()
        self._server.close()


def _concat(rows: list):
    """One array of the micro-batches' rows: on the device when any arrived there (CUDA IPC)."""
    if len(rows) == 1:
        return rows[0]
    if all(isinstance(r, np.ndarray) for r in rows):
        return np.concatenate(rows)
    import cupy as cp

    return cp.concatenate([cp.asarray(r) for r in rows])
