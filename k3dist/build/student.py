"""The calibration student never written: the uniform lo-bank build of a base build.

:class:`LoView` reads like a build (``k3dist.build.view``'s interface: config, manifest,
index, lazy arrays per prefix, the lazy model) over a base build on disk or the source's
view (``view.SourceView``): ``grade`` with no promotions, in memory. Each expert stack is
re-quantized with ``grade.requantize`` (runs of ``CHUNK_BYTES`` of codes, as ``grade``
writes them) when the layer's arrays are evaluated, a layer at a time as the stream runs;
config and ``build_hash`` are the written student's (``tests/test_view.py``: every tensor
equal to the written student's bytes, calibration's scores and routes equal).
"""

from __future__ import annotations

import hashlib
import json

from k3dist.build.grade import graded_config, identity, requantize
from k3dist.build.view import BuildFolder, SourceView, model_from
from k3dist.format.graded import LO, GradedMap, bank_of
from k3dist.format.qformat import QFormat
from k3dist.format.sfile import CHUNK_BYTES, CheckpointError

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import kimi_k3


class LoView:
    """The uniform lo-bank build of ``base`` (every expert in ``lo``), never written: the
    calibration student (module doc)."""

    def __init__(self, base: SourceView | BuildFolder, lo: str | QFormat):
        self.base, self.lo = base, QFormat.parse(lo) if isinstance(lo, str) else lo
        tc = base.config.get("text_config", base.config)
        self.gmap = GradedMap(tc["num_experts"], {}, {}, False, self.lo.name)
        self.config = graded_config(base.config, self.gmap, self.lo)
        ident = identity(base.manifest, self.gmap, self.lo)
        self.manifest = {
            "kind": "build",
            "identity": ident,
            "build_hash": hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[
                :16
            ],
            "view": "lo",
        }
        self.path = base.path
        self.index = {}
        for n, f in base.index.items():
            b = bank_of(n)
            if b is None:
                self.index[n] = f
            elif n.endswith(".weight"):
                stem = n[: -len(".weight")]
                for s in ("weight", "scales", "biases"):
                    self.index[f"{stem}.{s}"] = f

    def __str__(self) -> str:
        return f"{self.base} as its uniform {self.lo.name} build"

    def _lo(self, arrays: dict[str, mx.array]) -> dict[str, mx.array]:
        """The expert stacks among ``arrays`` re-quantized to the lo bank, in runs of
        experts as ``grade`` writes them (lazy)."""
        out = {}
        for n, a in arrays.items():
            b = bank_of(n)
            if b is None:
                out[n] = a
            elif n.endswith(".weight") and b[1] == LO:
                stem = n[: -len(".weight")]
                w, s = a, arrays[f"{stem}.scales"]
                E = w.shape[0]
                run = max(1, CHUNK_BYTES // (w.nbytes // E))
                parts = [
                    requantize(w[e : e + run], s[e : e + run], self.lo) for e in range(0, E, run)
                ]
                for k, suffix in enumerate(("weight", "scales", "biases")):
                    out[f"{stem}.{suffix}"] = mx.concatenate([p[k] for p in parts])
            elif not n.endswith(".scales"):
                raise CheckpointError(f"{self.base}: {n!r}: not an MXFP4 expert stack")
        return out

    def arrays(self, prefix: str) -> dict[str, mx.array]:
        return self._lo(self.base.arrays(prefix))

    def model(self, dtype: str = "float32") -> nn.Module:
        from k3dist.model import two_bank

        cls = two_bank.build_class(self.config)
        weights = self._lo(
            self.base.all_arrays() if isinstance(self.base, SourceView) else self.base.arrays("")
        )
        return model_from(self.config, weights, dtype, (cls, kimi_k3.ModelArgs))
