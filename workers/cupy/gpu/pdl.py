"""Programmatic dependent launch (Hopper): the next kernel of a decode step starts while this one finishes.

A small-batch decode step is a chain of ~75 dependent kernels, each a few microseconds of memory latency. With
the launch attribute PROGRAMMATIC_STREAM_SERIALIZATION, a kernel may be scheduled as soon as its predecessor's
blocks have all passed `griddepcontrol.launch_dependents`; it loads its weights (which depend on nothing) and
then blocks in `griddepcontrol.wait` until the predecessor has completed and its writes are visible. CuPy's
RawKernel cannot pass launch attributes, so these launches go through the driver's cuLaunchKernelEx (ctypes),
on CuPy's current stream: captured into CUDA graphs as programmatic edges like any other launch.
"""
from __future__ import annotations

import ctypes

import cupy as cp
import numpy as np

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _Attr(ctypes.Structure):  # CUlaunchAttribute: id, pad to 8, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("numAttrs", ctypes.c_uint)]


_lib = None


def _cuda():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                         ctypes.c_void_p]
        _lib = lib
    return _lib


def _value(a):
    if isinstance(a, cp.ndarray):
        return ctypes.c_void_p(a.data.ptr)
    if isinstance(a, np.uint64):
        return ctypes.c_uint64(int(a))
    if isinstance(a, np.int64):
        return ctypes.c_int64(int(a))
    if isinstance(a, np.int32):
        return ctypes.c_int32(int(a))
    if isinstance(a, np.float32):
        return ctypes.c_float(float(a))
    raise TypeError(f"kernel argument of type {type(a).__name__}")


def launch(func, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
    """Launch CuPy Function `func` with programmatic stream serialization on the current stream."""
    values = [_value(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    attr = _Attr()
    attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value[0] = 1  # programmaticStreamSerializationAllowed
    g = tuple(grid) + (1, 1)
    cfg = _Config(g[0], g[1], 1, block[0], 1, 1, shared_mem, ctypes.c_void_p(cp.cuda.get_current_stream().ptr),
                  ctypes.pointer(attr), 1)
    fn = getattr(func, "kernel", func)  # CuPy RawKernel -> its loaded cupy.cuda.Function
    rc = _cuda().cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(fn.ptr), params, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc}")
