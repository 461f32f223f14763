"""Adam over a flat dict of arrays with its moments kept in a chosen dtype: DWQ's
optimizer (``k3dist.pipeline.dwq``), where bf16 moments take a third of the memory."""

from __future__ import annotations

import mlx.core as mx


class Adam:
    """Adam on a flat dict of float32 arrays; ``m`` and ``v`` stored in ``dtype`` (the
    update is computed in float32). bf16's 8-bit mantissa drops ``v``'s 0.999 decay and
    increments under ~1/256 of ``v``: harmless over DWQ's tens of steps a block, not for
    thousands."""

    def __init__(
        self,
        b1: float = 0.9,
        b2: float = 0.999,
        eps: float = 1e-8,
        dtype: mx.Dtype = mx.float32,
    ):
        self.b1, self.b2, self.eps, self.dtype = b1, b2, eps, dtype
        self.m: dict[str, mx.array] = {}
        self.v: dict[str, mx.array] = {}
        self.t = 0

    def update(self, params: dict, grads: dict, lr: float) -> dict:
        self.t += 1
        out = {}
        for n, p in params.items():
            g = grads[n].astype(mx.float32)
            m = self.b1 * self.m.get(n, mx.zeros_like(g)).astype(mx.float32) + (1 - self.b1) * g
            v = self.b2 * self.v.get(n, mx.zeros_like(g)).astype(mx.float32) + (1 - self.b2) * g * g
            self.m[n], self.v[n] = m.astype(self.dtype), v.astype(self.dtype)
            mh = m / (1 - self.b1**self.t)
            vh = v / (1 - self.b2**self.t)
            out[n] = p - lr * mh / (mx.sqrt(vh) + self.eps)
        return out
