"""A stage actor: one device, a contiguous range of layers and their KV, a loop that reads activations
from the previous hop's socket, runs its layers and writes the result to the next hop.

Ray creates it (placement: `num_gpus`, custom resources) and tells it where to connect; after that the
actor's own thread serves the socket and Ray is out of the per-token path. Messages:
- "alloc": allocate KV for these layers (block count and size from the driver's block manager); forwarded.
- "run": one micro-batch (positions, KV slots, attention metadata, the residual stream); the output goes
  on with the same metadata, or, from the last stage, only the rows whose logits the driver wants.
- "stop": forwarded, then the loop ends. A failure becomes an "error" message the driver raises.
A closed or broken socket on either side (a neighbour died, or the driver tore the ring down to rebuild
it) ends the loop and closes this stage's outgoing socket, so the loss travels round the ring to the
driver; the driver then calls `connect` again (workers/pipeline/recovery.py) and the stage serves anew.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from workers.pipeline import cuda_ipc, wire
from workers.pipeline.cuda_ipc import IpcIn, IpcOut
from workers.pipeline.shm import ShmReader, ShmRing

log = logging.getLogger(__name__)
META = ("positions", "slot_mapping", "logits_indices", "query_start", "seq_lens", "block_tables",
        "local_slot_mapping", "local_block_tables")  # the last two only with a sliding-window pool


def build_layers(model_path: str | None, cache_dir: str | None, lo: int, hi: int, device: str, act: str,
                 max_model_len: int):
    from workers.cupy.gemma3 import Gemma3Config
    from workers.cupy.weights import load_weights
    from workers.protocol.model import load_model_info

    info = load_model_info(model_path)
    if info.architecture != "gemma3":
        raise ValueError(f"pipeline stages run gemma3 only (got {info.architecture!r})")
    cfg = Gemma3Config.from_hparams(info.hparams, info.vocab_size)
    weights = load_weights(info.path, cache_dir)
    if device == "cpu":
        from workers.pipeline.layers import NumpyLayers

        return NumpyLayers(cfg, weights, lo, hi)
    from workers.pipeline.gpu import GpuLayers

    return GpuLayers(cfg, weights, lo, hi, act=act, max_model_len=max_model_len)


class StageActor:
    """Wrapped with ray.remote by workers/pipeline/runner.py. `last`: send only the logits rows back."""

    def __init__(self, model_path: str | None, cache_dir: str | None, lo: int, hi: int, device: str,
                 last: bool, bind_host: str = "127.0.0.1", act: str = "float16", max_model_len: int = 8192,
                 cpu_threads: int | None = 1):
        if device == "cpu" and cpu_threads:
            from threadpoolctl import threadpool_limits

            threadpool_limits(cpu_threads)  # as the single-stage NumPy engine: no BLAS spin-waiting
        self.lo, self.hi, self.last, self.device = lo, hi, last, device
        self.layers = build_layers(model_path, cache_dir, lo, hi, device, act, max_model_len)
        self.server = wire.listener(bind_host)
        self.host = bind_host if bind_host != "0.0.0.0" else _node_ip()
        self._thread: threading.Thread | None = None
        self.down = self.ring = None
        self.ipc: dict = {}
        self._send_s = 0.0

    def address(self) -> tuple[str, int]:
        return self.host, self.server.getsockname()[1]

    def pid(self) -> int:
        return os.getpid()

    def connect(self, host: str, port: int, shm: bool = False, ipc: dict | None = None) -> bool:
        """Connect to the next hop and start serving the previous one (which connects to `address()`).
        Called again after a ring was torn down: the old loop has ended (its sockets closed) or ends soon.
        `shm`: the next hop shares this host; the arrays go through a shared-memory ring (shm.py).
        `ipc` (cuda_ipc.py): {"in": (slots, slot bytes) of a device ring for the incoming hop, or None;
        "out": whether the outgoing hop moves the residual stream through the next one's ring}."""
        if self._thread is not None:
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                raise RuntimeError(f"stage {self.lo}-{self.hi} is still serving the old ring")
        self.down = wire.connect(host, port)
        self.ring = ShmRing() if shm else None
        self.ipc = ipc or {}
        if hasattr(self.layers, "device_out"):  # GpuLayers: keep the output on the device for the IPC hop
            self.layers.device_out = bool(self.ipc.get("out"))
        self._thread = threading.Thread(target=self._serve, name=f"stage-{self.lo}-{self.hi}", daemon=True)
        self._thread.start()
        return True

    def _serve(self) -> None:
        up, _ = self.server.accept()
        wire.tune(up)
        reader = ShmReader()
        ipc_in = ipc_out = None
        try:
            ipc_in = IpcIn(up, *self.ipc["in"]) if self.ipc.get("in") else None
            ipc_out = IpcOut(self.down) if self.ipc.get("out") else None
            self._loop(up, reader, ipc_in, ipc_out)
        except OSError as exc:  # a neighbour went away (ConnectionError is an OSError): pass the loss on
            log.warning("stage %d-%d: ring closed (%s)", self.lo, self.hi, exc)
        finally:
            up.close()
            self.down.close()
            reader.close()
            if self.ring is not None:
                self.ring.close()
            for end in (ipc_in, ipc_out):
                if end is not None:
                    end.close()

    def _loop(self, up, reader: ShmReader, ipc_in: IpcIn | None = None, ipc_out: IpcOut | None = None) -> None:
        while True:
            header, arrays, _, recv_s = cuda_ipc.recv(up, reader, ipc_in)
            t0 = time.perf_counter()
            kind = header["kind"]
            try:
                if kind == "run":
                    arrays = self._run(header, arrays)
                elif kind == "alloc":
                    self.layers.alloc_kv(header["num_blocks"], header["block_size"], header.get("max_seqs", 0),
                                         header.get("num_local"))
            except Exception as exc:  # the driver raises it; the stage keeps serving
                log.exception("stage %d-%d failed", self.lo, self.hi)
                header = {"kind": "error", "mb": header.get("mb"), "message": f"stage {self.lo}-{self.hi}: {exc}"}
                arrays = {}
            if kind == "run" or header["kind"] == "error":
                header.setdefault("compute_s", []).append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            if ipc_out is not None:  # the output device to device, on the stream that computed it
                header, arrays, _ = ipc_out.pack(header, arrays)
            wire.send(self.down, header | {"hop_s": header.get("hop_s", 0.0) + recv_s + self._send_s}, arrays,
                      self.ring)
            reader.release()  # the input (read in place from a shared-memory ring) is done with
            # this hop's send time rides on the next message (the one just sent cannot carry its own)
            self._send_s = time.perf_counter() - t1
            if kind == "stop":
                return

    def _run(self, header: dict, a: dict) -> dict:
        from workers.pipeline.layers import stage_batch

        x = self.layers.run(a["x"], stage_batch(a, header["block_size"]), self.last)
        return {"x": x} if self.last else {**{k: a[k] for k in META if k in a}, "x": x}


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()
