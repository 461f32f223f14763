"""Load a fast BLAS into the process before MLX does, on Linux.

The Linux ``mlx[cpu]`` wheel links the reference BLAS (~6 GFLOP/s float32 matmul
here). Loading OpenBLAS with ``RTLD_GLOBAL`` before ``mlx.core`` is first imported
makes MLX's ``sgemm`` calls resolve to it (~30x faster). macOS uses Accelerate and
needs nothing. Where no OpenBLAS is installed this is a no-op; ``blas_status()``
says which one is active so benchmarks can print it.
"""

from __future__ import annotations

import ctypes
import glob
import sys

# Debian/Ubuntu's libopenblas0-pthread first; then other common layouts.
_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

_status: dict = {"loaded": None, "reason": "not attempted"}


def preload() -> dict:
    """Load OpenBLAS globally if possible; safe to call more than once."""
    if _status["reason"] != "not attempted":
        return _status
    if not sys.platform.startswith("linux"):
        _status.update(reason="not Linux: MLX uses the platform BLAS")
        return _status
    if "mlx.core" in sys.modules:
        _status.update(reason="mlx.core was imported before k3dist: import k3dist first")
        return _status
    for path in _CANDIDATES + tuple(sorted(glob.glob("/usr/lib/*/libopenblas*.so*"))):
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        _status.update(loaded=path, reason="loaded")
        return _status
    _status.update(reason="no OpenBLAS found (apt-get install libopenblas0-pthread)")
    return _status


def blas_status() -> dict:
    return dict(_status)


def set_threads(n: int) -> bool:
    """Cap OpenBLAS's threads (several ranks on one box would oversubscribe its
    cores). Returns False where no OpenBLAS was loaded."""
    if not _status["loaded"]:
        return False
    lib = ctypes.CDLL(_status["loaded"], mode=ctypes.RTLD_GLOBAL)
    lib.openblas_set_num_threads(int(n))
    _status["threads"] = int(n)
    return True
