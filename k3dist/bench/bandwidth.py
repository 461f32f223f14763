"""This machine's memory bandwidth, as the cost model's ``bw_fraction`` would need it:
a streaming read (numpy) and what MLX's matvec kernels achieve on the same memory
(``benchmarks/speed/project.py --calibrate``)."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np


def measure_bandwidth(reps: int = 5) -> dict:
    """This machine: streaming read bandwidth (numpy) and what MLX's matvec kernels
    achieve on the same memory (bf16 and MXFP4 expert-shaped weights)."""

    def best(fn, n=reps):
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return min(ts)

    a = np.ones(2**26, dtype=np.float64)  # 512 MiB
    stream = a.nbytes / best(a.sum)
    del a
    w = mx.ones((8192, 7168), dtype=mx.bfloat16)
    x = mx.ones((1, 7168), dtype=mx.bfloat16)
    mx.eval(w, x)
    bf16 = w.nbytes / best(lambda: mx.eval(x @ w.T))
    E = 16  # 16 expert-shaped w1 matrices (94 MB): more than the caches
    q = mx.random.randint(0, 2**31, (E, 3072, 3584 // 8)).astype(mx.uint32)
    s = mx.random.randint(118, 130, (E, 3072, 3584 // 32)).astype(mx.uint8)
    xe = mx.ones((1, 3584), dtype=mx.bfloat16)
    mx.eval(q, s, xe)

    def qmv():
        mx.eval(
            [
                mx.quantized_matmul(
                    xe, q[e], s[e], None, transpose=True, group_size=32, bits=4, mode="mxfp4"
                )
                for e in range(E)
            ]
        )

    mxfp4 = (q.nbytes + s.nbytes) / best(qmv, 2)
    return {
        "stream_read_GBps": round(stream / 1e9, 2),
        "mlx_bf16_matvec_GBps": round(bf16 / 1e9, 2),
        "mlx_mxfp4_matvec_GBps": round(mxfp4 / 1e9, 3),
        "bf16_fraction_of_stream": round(bf16 / stream, 3),
        "mxfp4_fraction_of_stream": round(mxfp4 / stream, 4),
        "device": str(mx.default_device()),
    }
