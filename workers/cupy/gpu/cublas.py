"""cuBLAS GEMMs through ctypes, so matrix products can be captured in CUDA graphs.

CuPy refuses any cuBLAS call during stream capture (`NotImplementedError: calling cuBLAS API during stream
capture is currently unsupported`), even through its raw bindings; cuBLAS itself captures fine. So the engine
calls `cublasGemmEx` on its own handle, loaded with ctypes from the CUDA toolkit (or the nvidia-cublas wheel
CuPy uses), with a fixed workspace set up front so nothing is allocated while a graph is being captured.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys

import cupy as cp

CUDA_R_16F, CUDA_R_32F, CUDA_R_16BF = 2, 0, 14
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
_ACT_TYPES = {"float16": CUDA_R_16F, "bfloat16": CUDA_R_16BF}


def _candidates() -> list[str]:
    names = ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]
    dirs = [os.environ.get("CUDA_HOME", "/usr/local/cuda") + "/lib64", "/usr/local/cuda/lib64"]
    dirs += [os.path.join(p, "nvidia", "cublas", "lib") for p in sys.path if p]
    dirs += [os.path.join(p, "nvidia", "cu13", "lib") for p in sys.path if p]
    found = [f for d in dirs for f in sorted(glob.glob(os.path.join(d, "libcublas.so*")), reverse=True)
             if "Lt" not in os.path.basename(f)]
    return names + found


def load_cublas() -> ctypes.CDLL:
    errors = []
    for name in _candidates():
        try:
            lib = ctypes.CDLL(name)
            lib.cublasGemmEx  # noqa: B018 (the symbol must be there)
            return lib
        except (OSError, AttributeError) as e:
            errors.append(f"{name}: {e}")
    raise OSError("no usable libcublas found:\n" + "\n".join(errors[-6:]))


class CublasError(RuntimeError):
    pass


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasError(f"{what} failed with cublasStatus {status}")


class Cublas:
    """One cuBLAS handle with a fixed workspace; `linear` = x @ w.T into an fp32 output."""

    def __init__(self, act: str = "float16", workspace_bytes: int = 32 << 20):
        self.lib = load_cublas()
        self.act_type = _ACT_TYPES[act]
        self.handle = ctypes.c_void_p()
        _check(self.lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        # a fixed workspace: cuBLAS must not allocate while a CUDA graph is being captured
        self.workspace = cp.empty(workspace_bytes, dtype=cp.uint8)
        _check(self.lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(self.workspace.data.ptr),
                                              ctypes.c_size_t(workspace_bytes)), "cublasSetWorkspace")
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._stream = None
        g = self.lib.cublasGemmEx
        g.restype = ctypes.c_int
        g.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                      ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int]

    def bind_current_stream(self) -> None:
        """Issue later GEMMs on CuPy's current stream (the capture stream while capturing)."""
        ptr = cp.cuda.get_current_stream().ptr
        if ptr != self._stream:
            _check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(ptr)), "cublasSetStream")
            self._stream = ptr

    def linear(self, x, w, out) -> None:
        """out[M, N] (fp32) = x[M, K] @ w[N, K].T, x and w in the activation dtype, all C-contiguous.

        Row-major Y = X W^T is column-major Y^T = W^T(op T on W's col-major view) X^T, hence (T, N).
        """
        m, k = x.shape
        n = w.shape[0]
        assert w.shape[1] == k and out.shape == (m, n), (x.shape, w.shape, out.shape)
        assert x.flags.c_contiguous and w.flags.c_contiguous and out.flags.c_contiguous
        self.bind_current_stream()
        _check(self.lib.cublasGemmEx(
            self.handle, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, ctypes.byref(self._one),
            w.data.ptr, self.act_type, k, x.data.ptr, self.act_type, k, ctypes.byref(self._zero),
            out.data.ptr, CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT), "cublasGemmEx")

    def close(self) -> None:
        if self.handle:
            self.lib.cublasDestroy_v2(self.handle)
            self.handle = ctypes.c_void_p()
