"""Same-host GPU hops: activations device to device through CUDA IPC, the socket still the doorbell.

NCCL refuses two ranks on one GPU, and two stage processes sharing a GPU is the case this must serve (as
well as peer GPUs of one host), so each hop whose two ends are CUDA processes on one host moves its
residual stream through CUDA IPC (CuPy's runtime bindings) and keeps its TCP socket for everything else:
the message header (what the step is), the small metadata arrays, the receiver's wake-up, and the loss of a
peer (a closed socket), exactly as on the other transports.

One hop, sender S to receiver R:
- R owns the ring: K slots of device memory (one cudaMalloc, sized for the largest message: max step tokens
  x hidden x 4 bytes of fp32 residual), per slot two interprocess events, `ready` (S records it after its
  copy into the slot) and `consumed` (R records it after its copy out), and a `taken` counter in a small
  /dev/shm file (how many messages R has taken). Once it accepts S's connection R sends the handles back on
  that socket (the "offer"); S reads it at its first array send and opens them.
- S, per message: picks slot k = sent % K, makes its stream wait on consumed[k], copies x into the slot
  (cudaMemcpyAsync on its stream, after the kernels that produced x), records ready[k], and sends the header
  with {slot, dtype, shape} on the socket.
- R, on that header: makes its stream wait on ready[k], copies the slot into a fresh array on its stream,
  records consumed[k], then bumps `taken`. The copy out frees the slot at once, whatever R does with x.

Why event reuse is safe (the host-side order): a stream wait uses the event's latest record *at the time of
the wait call*. R's wait on ready[k] for message m must come after S's record for m (it does: S sends the
header only after recording) and before S's record for m + K, the slot's next use. S's wait on consumed[k]
for m + K must come after R's record for m (and R records for m + K only after that header). Both hold
if S writes message m + K only once R has taken message m, and that is what the `taken` counter checks: S
uses a slot only when sent - taken < K (SlotBook), else the message goes through host memory as on the shm
transport (counted as a fallback), so a sender never waits and never races. K is chosen larger than the
messages that can be in flight on a hop: the driver has at most max(micro_batches, groups) messages in the
ring before it collects, and every hop sees a message only after the driver launched it, so with
K >= that + 2 the counter never stops a send in practice (build.py: ring_slots).
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import time
import uuid
from dataclasses import dataclass

import numpy as np

from workers.pipeline import shm, wire

log = logging.getLogger(__name__)

TRANSPORT = "cuda_ipc"
_LOOPBACK = {"127.0.0.1", "localhost"}
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: unified addressing finds each side's device
_ALIGN = 256


def cupy_or_none():
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def available() -> bool:
    """CuPy importable and a CUDA device present in this process."""
    cp = cupy_or_none()
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device: CuPy raises its CUDA errors
        return False


# --- choosing the transport by placement (pure) ---------------------------------------------------------
@dataclass(frozen=True)
class End:
    """One end of the ring: the driver or a stage, where it runs and on what."""

    host: str
    device: str  # "cpu" | "cuda"


def same_host(a: str, b: str) -> bool:
    return a == b or {a, b} <= _LOOPBACK


def plan_hops(ends: list[End], enabled: bool = True, cupy_ok: bool = True) -> list[bool]:
    """Per hop of the ring (ends in ring order: driver, stage 0 .. n-1; hop i goes from ends[i] to the next,
    the last hop back to the driver): CUDA IPC when both ends are CUDA processes on one host. Whether the two
    devices reach each other is checked again when the hop is wired (`reachable`), falling back then."""
    if not (enabled and cupy_ok):
        return [False] * len(ends)
    pairs = [(ends[i], ends[(i + 1) % len(ends)]) for i in range(len(ends))]
    return [a.device == b.device == "cuda" and same_host(a.host, b.host) for a, b in pairs]


def label(hops: list[bool], base: str) -> str:
    """The transport name on /metrics: "cuda_ipc" when every hop is, else `base`, or both when mixed."""
    if hops and all(hops):
        return TRANSPORT
    return f"{TRANSPORT}+{base}" if any(hops) else base


def reachable(mine: dict, theirs: dict) -> bool:
    """Whether this process's device can use the other end's device memory (facts from `device_facts`)."""
    if mine["boot"] != theirs["boot"]:  # another machine: its handles mean nothing here
        return False
    if mine["pci"] == theirs["pci"] or theirs["pci"] in mine["peers"] or mine["pci"] in theirs["peers"]:
        return True
    # their device is hidden from this process (CUDA_VISIBLE_DEVICES): peer access cannot be asked here, and
    # cudaIpcOpenMemHandle may still open it; opening decides (a failure falls back to host memory)
    return theirs["pci"] not in mine["visible"]


def boot_id() -> str:
    """One value per running kernel: two processes with the same one share a host (and its GPUs)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def device_facts() -> dict:
    """This process's current device as the other end checks it: PCI bus id, the visible devices, and those
    the current one can reach as a peer."""
    import cupy as cp

    rt = cp.cuda.runtime
    dev = cp.cuda.Device().id
    visible = [rt.deviceGetPCIBusId(i) for i in range(rt.getDeviceCount())]
    peers = [visible[i] for i in range(len(visible)) if i != dev and rt.deviceCanAccessPeer(dev, i)]
    return {"boot": boot_id(), "pci": visible[dev], "visible": visible, "peers": peers}


# --- slot bookkeeping (pure) ----------------------------------------------------------------------------
class SlotBook:
    """The sender's count of messages put into one hop's K slots (the module docstring says why a slot is
    reused only once the receiver has taken the message that used it before)."""

    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError("a CUDA IPC ring needs at least one slot")
        self.slots, self.sent = slots, 0

    def next_slot(self, taken: int) -> int | None:
        """The slot for the next message, or None while its previous message is not taken yet."""
        if self.sent - taken >= self.slots:
            return None
        return self.sent % self.slots

    def commit(self) -> None:
        self.sent += 1


class TakenCounter:
    """How many messages the receiver has taken: 8 bytes in /dev/shm, written by the receiver (its creator),
    read by the sender. Named after the receiver's pid, so shm.remove_rings clears it after a crash."""

    def __init__(self, path: str | None = None):
        self.owner = path is None
        self.path = path or f"{shm._PREFIX}{os.getpid()}-ipc-{uuid.uuid4().hex[:12]}"
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR if self.owner else os.O_RDWR
        fd = os.open(self.path, flags, 0o600)
        try:
            if self.owner:
                os.ftruncate(fd, 8)
            self._map = mmap.mmap(fd, 8)
        finally:
            os.close(fd)
        self._value = np.frombuffer(self._map, np.uint64, 1)

    @property
    def value(self) -> int:
        return int(self._value[0])

    def bump(self) -> None:
        self._value[0] += 1

    def close(self) -> None:
        del self._value
        self._map.close()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


# --- the device side ------------------------------------------------------------------------------------
class IpcRing:
    """The receiving side of one hop: owns the slots, the events and the counter."""

    def __init__(self, slots: int, slot_bytes: int):
        import cupy as cp

        self.cp, self.slots, self.slot_bytes = cp, slots, _round_up(slot_bytes)
        # a raw cudaMalloc, not CuPy's pool: an IPC handle names a whole allocation, and a pool block is a
        # piece of a larger one
        self.mem = cp.cuda.memory.Memory(self.slots * self.slot_bytes)
        ev = dict(block=False, disable_timing=True, interprocess=True)
        self.ready = [cp.cuda.Event(**ev) for _ in range(slots)]
        self.consumed = [cp.cuda.Event(**ev) for _ in range(slots)]
        self.taken = TakenCounter()

    def offer(self) -> dict:
        rt = self.cp.cuda.runtime
        return {"kind": "ipc-ring", "ok": True, "facts": device_facts(), "slots": self.slots,
                "slot_bytes": self.slot_bytes, "mem": rt.ipcGetMemHandle(self.mem.ptr),
                "ready": [rt.ipcGetEventHandle(e.ptr) for e in self.ready],
                "consumed": [rt.ipcGetEventHandle(e.ptr) for e in self.consumed], "counter": self.taken.path}

    def take(self, slot: int, dtype: str, shape: list[int]):
        """Message `taken`'s array, copied out of its slot on the current stream (ordered after the
        sender's copy in); the slot is free for the sender again from here."""
        cp = self.cp
        if slot != self.taken.value % self.slots:
            raise ConnectionError(f"CUDA IPC message in slot {slot}, expected {self.taken.value % self.slots}")
        stream = cp.cuda.get_current_stream()
        stream.wait_event(self.ready[slot])
        out = cp.empty(shape, dtype)
        cp.cuda.runtime.memcpyAsync(out.data.ptr, self.mem.ptr + slot * self.slot_bytes, out.nbytes,
                                    _MEMCPY_DEFAULT, stream.ptr)
        self.consumed[slot].record(stream)
        self.taken.bump()  # after the record: the sender may now wait on it and reuse the slot
        return out

    def close(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()  # nothing of ours still reads a slot
        self.taken.close()
        self.ready = self.consumed = self.mem = None


class IpcSender:
    """The sending side of one hop: the receiver's offer opened in this process."""

    def __init__(self, offer: dict):
        import cupy as cp

        if not reachable(device_facts(), offer["facts"]):
            raise RuntimeError(f"device {offer['facts']['pci']} is not reachable from this one")
        rt = self.rt = cp.cuda.runtime
        self.cp, self.slot_bytes = cp, offer["slot_bytes"]
        self.ptr = rt.ipcOpenMemHandle(offer["mem"])
        self.ready = [rt.ipcOpenEventHandle(h) for h in offer["ready"]]
        self.consumed = [rt.ipcOpenEventHandle(h) for h in offer["consumed"]]
        self.taken = TakenCounter(offer["counter"])
        self.book = SlotBook(offer["slots"])

    def put(self, x) -> dict | None:
        """Copy `x` into the next slot on the current stream: the header's {slot, dtype, shape}, or None when
        it must go through host memory (larger than a slot, or the slot not yet taken back)."""
        if x.nbytes > self.slot_bytes:
            return None
        slot = self.book.next_slot(self.taken.value)
        if slot is None:
            return None
        cp, rt = self.cp, self.rt
        x = cp.ascontiguousarray(x)
        stream = cp.cuda.get_current_stream()
        rt.streamWaitEvent(stream.ptr, self.consumed[slot])
        rt.memcpyAsync(self.ptr + slot * self.slot_bytes, x.data.ptr, x.nbytes, _MEMCPY_DEFAULT, stream.ptr)
        rt.eventRecord(self.ready[slot], stream.ptr)
        self.book.commit()
        return {"slot": slot, "dtype": x.dtype.str, "shape": list(x.shape)}

    def close(self) -> None:
        with contextlib.suppress(Exception):  # the receiver may be gone already
            self.cp.cuda.get_current_stream().synchronize()
        for ev in self.ready + self.consumed:
            with contextlib.suppress(Exception):
                self.rt.eventDestroy(ev)
        with contextlib.suppress(Exception):
            self.rt.ipcCloseMemHandle(self.ptr)
        self.taken.close()


# --- a hop's two ends, as stage.py and runner.py use them -----------------------------------------------
class IpcIn:
    """The receiving end of a CUDA IPC hop: makes the ring and sends its offer back on the accepted socket
    (an offer saying "ok": False when it cannot, so the sender never waits for one that does not come)."""

    def __init__(self, sock, slots: int, slot_bytes: int):
        self.ring = None
        try:
            self.ring = IpcRing(slots, slot_bytes)
            offer = self.ring.offer()
        except Exception as exc:  # no CuPy, no device, IPC refused: the sender uses host memory
            log.warning("CUDA IPC ring not made (%s); this hop moves activations through host memory", exc)
            offer = {"kind": "ipc-ring", "ok": False, "why": str(exc)}
        wire.send(sock, offer, {})

    def unpack(self, header: dict, arrays: dict) -> dict:
        """The message's arrays with `x` taken from its slot when the header says it is in one."""
        where = header.pop("ipc", None)
        if where is None:
            return arrays
        if self.ring is None:
            raise ConnectionError("a CUDA IPC message on a hop without a CUDA IPC ring")
        return {**arrays, "x": self.ring.take(**where)}

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None


class IpcOut:
    """The sending end of a CUDA IPC hop. `pack` moves a device `x` into the receiver's ring (or, when the
    ring cannot take it, to the host) and counts hops in the header ("ipc_n", "ipc_fb") for the stats."""

    def __init__(self, sock):
        self.sock, self.sender, self.opened = sock, None, False

    def _open(self) -> None:
        self.opened = True
        offer, _, _, _ = wire.recv(self.sock)  # sent by the receiver when it accepted this connection
        if offer.get("kind") != "ipc-ring" or not offer.get("ok"):
            log.warning("CUDA IPC hop refused by the receiver (%s): host memory instead", offer.get("why"))
            return
        try:
            self.sender = IpcSender(offer)
        except Exception as exc:
            log.warning("CUDA IPC ring not opened (%s): this hop moves activations through host memory", exc)

    def pack(self, header: dict, arrays: dict) -> tuple[dict, dict, int]:
        """(header, arrays for the socket, bytes moved through the ring)."""
        x = arrays.get("x")
        if x is None or isinstance(x, np.ndarray):
            return header, arrays, 0
        if not self.opened:
            self._open()
        _peer_alive(self.sock)  # never copy into the memory of a receiver that is gone
        where = None
        if self.sender is not None:
            try:
                where = self.sender.put(x)
            except Exception as exc:  # a copy this pair of devices refuses after all: host memory from now on
                if isinstance(exc, OSError):
                    raise
                log.warning("CUDA IPC copy failed (%s): this hop moves activations through host memory", exc)
                self.close()
        if where is None:
            return header | {"ipc_fb": header.get("ipc_fb", 0) + 1}, {**arrays, "x": x.get()}, 0
        rest = {k: v for k, v in arrays.items() if k != "x"}
        return header | {"ipc": where, "ipc_n": header.get("ipc_n", 0) + 1}, rest, int(x.nbytes)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None


def recv(sock, reader, ipc_in: IpcIn | None):
    """wire.recv, then the residual stream from this end's device ring when the header says it is there:
    (header, arrays, bytes, seconds), both counting the slot's copy."""
    header, arrays, n, recv_s = wire.recv(sock, reader)
    if ipc_in is not None and "ipc" in header:
        t0 = time.perf_counter()
        arrays = ipc_in.unpack(header, arrays)
        recv_s += time.perf_counter() - t0
        n += int(arrays["x"].nbytes)
    return header, arrays, n, recv_s


def _peer_alive(sock) -> None:
    """The receiver writes nothing on this socket after its offer: readable means it closed (EOF) or broke."""
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return
    if not data:
        raise ConnectionError("the pipeline peer closed its connection")


def to_host(x):
    """A device array's host copy (arrays already on the host as they are)."""
    return x if isinstance(x, np.ndarray) else x.get()
