"""The engine in a process of its own, so that its step thread has a GIL to itself.

In one process the engine's step thread and the worker's event loop (detokenizing, stop strings, one write per
stream per hand-over) share one GIL. On the H200 at 256 streams the worker process sat at ~0.9 of a core with
the step thread at 63% of it: the engine alone ran 1.5–2x faster than the same engine serving (BENCHMARKS.md,
issue 25). With `workers.engine.process` the worker process keeps everything asyncio (StreamServer, the
per-request streams) and a child process, started with `python -m workers.cupy.engine_process`, holds the engine
(weights, KV, the device) and its EngineLoop. This is the split vLLM makes between its API server and its
engine core; what crosses is token ids, not text.

The channel is one socketpair, framed and pickled by multiprocessing.connection.Connection (both sides are the same
Python and Pulse, started together; nothing else can reach the socket). Worker -> engine: ("add",
GenerateRequest), ("abort", id), ("grammar", token, schema), ("blocks", token), ("stop",). Engine -> worker:
("ready", (device,
stats)), ("failed", message), ("out", msgpack bytes of [StepOutput, ...]) one per hand-over (msgspec: ~5x
cheaper than pickling them, on the per-token path of both processes), ("one", id, item), ("block", BlockEvent),
("stats", {...}) every STATS_EVERY_S, ("reply", token, value, BackendError or None), ("health", bool). The engine process
exits when the socket closes, so a worker killed with SIGKILL does not leave its engine holding the GPU.
"""
from __future__ import annotations

import importlib
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

import msgspec

log = logging.getLogger(__name__)

STATS_EVERY_S = 0.05  # as often as a gateway polls while requests wait for places (gateway/pool.py poll_delay)
START_TIMEOUT_S = 600.0  # the first start dequantizes and caches weights; a GPU engine captures its graphs


def builder(path: str):
    """'module:function' -> the function."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class EngineProcess:
    """The worker process's end: starts the engine process and carries messages both ways.

    `on_message(msg)` is called from this object's reader thread for everything the engine sends after "ready";
    `on_lost(message)` once when the socket closes or the process exits unasked."""

    def __init__(self, spec: dict, on_message, on_lost):
        self.spec, self.on_message, self.on_lost = spec, on_message, on_lost
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self._reader: threading.Thread | None = None
        self._closing = False
        self._send_lock = threading.Lock()

    def start(self) -> str:
        """Start the engine process and wait until its engine is built; returns its device's name. Blocking
        (run it in a thread)."""
        ours, theirs = socket.socketpair()
        for s in (ours, theirs):  # a hand-over at 256 streams is tens of KB; room for several in flight
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        fd = theirs.fileno()
        env = os.environ.copy()  # the same imports as this process (a Ray worker's path is not all in the env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self.proc = subprocess.Popen([sys.executable, "-m", "workers.cupy.engine_process", str(fd)],
                                     pass_fds=(fd,), env=env)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(self.spec)
        try:
            if not self.conn.poll(START_TIMEOUT_S):
                raise RuntimeError(f"the engine process did not start in {START_TIMEOUT_S:.0f} s")
            kind, detail = self.conn.recv()
        except (EOFError, OSError) as exc:
            code = self.proc.wait(timeout=10)
            raise RuntimeError(f"the engine process exited while starting (exit code {code})") from exc
        except BaseException:
            self.kill()
            raise
        if kind != "ready":
            self.kill()
            raise RuntimeError(f"the engine process could not build its engine: {detail}")
        device, snapshot = detail
        self.on_message(("stats", snapshot))
        self._reader = threading.Thread(target=self._read, name="engine-process-reader", daemon=True)
        self._reader.start()
        return device

    def send(self, msg) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def _read(self) -> None:
        conn, on_message = self.conn, self.on_message
        try:
            while True:
                on_message(conn.recv())
        except (EOFError, OSError):
            pass
        except Exception:  # a message this side cannot take: the channel is no longer trustworthy
            log.exception("engine process channel failed")
        if not self._closing:
            code = self.proc.poll() if self.proc else None
            self.on_lost(f"the engine process exited (exit code {code})" if code is not None
                         else "the engine process's channel closed")

    def close(self, timeout: float = 30.0) -> None:
        """Ask the engine to stop, wait for the process, kill it if it does not go. Blocking."""
        self._closing = True
        try:
            self.send(("stop",))
        except (OSError, ValueError):
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        if self.conn is not None:
            self.conn.close()
        if self._reader is not None:
            self._reader.join(timeout=5)

    def kill(self) -> None:
        self._closing = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


# --- the engine process -------------------------------------------------------------------------------------
def main(fd: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine: %(message)s")
    conn = Connection(fd)
    send_lock = threading.Lock()

    def send(msg) -> None:
        with send_lock:
            conn.send(msg)

    spec = conn.recv()
    try:
        engine = builder(spec["builder"])(*spec["args"], block_sink=lambda event: send(("block", event)))
    except BaseException as exc:  # anything: the worker reports it and the process ends
        log.exception("engine build failed")
        send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    from workers.cupy.engine_loop import STOP, EngineLoop, engine_snapshot, quiet_gc

    if spec.get("quiet_gc"):
        quiet_gc()  # the engine as built is frozen out of every collection from now on

    encode = msgspec.msgpack.Encoder().encode
    core = EngineLoop(engine, emit=lambda outputs: send(("out", encode(outputs))),
                      emit_one=lambda rid, item: send(("one", rid, _picklable(item))),
                      on_health=lambda ok: send(("health", ok)),
                      hold_s_per_stream=spec["hold_s_per_stream"])
    stepper = threading.Thread(target=core.run, name="engine", daemon=True)
    stepper.start()
    stopped = threading.Event()

    def report_stats() -> None:
        while not stopped.wait(STATS_EVERY_S):
            try:
                send(("stats", engine_snapshot(engine)))
            except (OSError, ValueError):
                return
            except Exception:  # read mid-step from another thread: the next reading will do
                log.debug("stats snapshot failed", exc_info=True)

    threading.Thread(target=report_stats, name="engine-stats", daemon=True).start()
    compiles = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
    send(("ready", (_device_of(engine), engine_snapshot(engine))))
    try:
        while True:
            msg = conn.recv()
            kind = msg[0]
            if kind == "add" or kind == "abort":
                core.inbox.put(msg)
            elif kind == "grammar":
                compiles.submit(_compile, engine, msg[1], msg[2], send)
            elif kind == "blocks":  # the prefix index's snapshot: every cached block hash, read between steps' edits
                send(("reply", msg[1], engine.blocks.cached_hashes(), None))
            elif kind == "stop":
                break
    except (EOFError, OSError):  # the worker is gone: nothing will read what this engine makes
        os._exit(0)
    stopped.set()
    core.inbox.put((STOP, None))
    stepper.join()
    close = getattr(engine, "close", None)
    if callable(close):
        close()
    compiles.shutdown(wait=False, cancel_futures=True)
    conn.close()


def _compile(engine, token: int, schema: str, send) -> None:
    from workers.cupy.backend import compile_grammar
    from workers.protocol import BackendError

    try:
        compile_grammar(engine, schema)
        reply = ("reply", token, None, None)
    except BackendError as exc:
        reply = ("reply", token, None, exc)
    except Exception as exc:  # anything else the compiler raised: the worker answers 503 with it
        reply = ("reply", token, None, BackendError(str(exc), 503))
    try:
        send(reply)
    except (OSError, ValueError):
        pass


def _picklable(item):
    """An error as one the worker process can rebuild (exceptions from libraries may not pickle)."""
    if isinstance(item, BaseException):
        try:
            pickle.dumps(item)
        except Exception:
            return RuntimeError(str(item))
    return item


def _device_of(engine) -> str:
    return getattr(engine, "device_name", "") or "cpu"


if __name__ == "__main__":
    main(int(sys.argv[1]))
