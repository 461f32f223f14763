"""Graded builds never written: the calibration student and DWQ's student.

:class:`GradedView` reads like a build (``k3dist.pipeline.view``'s interface: config,
manifest, index, lazy arrays per prefix, the lazy model) over a base build on disk or the
source's view (``view.SourceView``): ``grade`` in memory. The promoted experts' MXFP4 rows
are taken as they are (hi bank), every other expert is re-quantized with
``grade.requantize`` (runs of consecutive lo experts of up to ``CHUNK_BYTES`` of codes, as
``grade`` writes them) when the layer's arrays are evaluated, a layer at a time as the
stream runs; config and ``build_hash`` are the written graded build's.

- :class:`LoView`: no promotions, the uniform lo-bank build: calibration's student
  (``tests/pipeline/test_view.py``: every tensor equal to the written student's bytes,
  calibration's scores and routes equal).
- a :class:`GradedView` of the graded map in the rank folders' config: DWQ's student
  when the graded build went straight into rank folders (``k3dist.pipeline.dwq``).
"""

from __future__ import annotations

import hashlib
import json

from k3dist.format.graded import HI, LO, GradedMap, bank_of
from k3dist.format.qformat import QFormat
from k3dist.format.sfile import CHUNK_BYTES, CheckpointError
from k3dist.pipeline.promote import expert_runs, graded_config, identity, requantize
from k3dist.pipeline.view import BuildFolder, SourceView, model_from

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import kimi_k3


class GradedView:
    """The graded build of ``base`` for ``gmap`` with its lo bank in ``lo``, never written
    (module doc)."""

    def __init__(self, base: SourceView | BuildFolder, gmap: GradedMap, lo: str | QFormat):
        self.base, self.lo = base, QFormat.parse(lo) if isinstance(lo, str) else lo
        self.gmap = gmap
        self.config = graded_config(base.config, self.gmap, self.lo)
        ident = identity(base.manifest, self.gmap, self.lo)
        self.manifest = {
            "kind": "build",
            "identity": ident,
            "build_hash": hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[
                :16
            ],
            "view": "graded",
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
                if self.gmap.hi_ids(b[0]):
                    hi = stem.replace(f".{LO}.", f".{HI}.")
                    for s in ("weight", "scales"):
                        self.index[f"{hi}.{s}"] = f

    def __str__(self) -> str:
        return f"{self.base} as its graded build (lo {self.lo.name})"

    def _lo(self, arrays: dict[str, mx.array]) -> dict[str, mx.array]:
        """The expert stacks among ``arrays`` split into the banks: the promoted rows as
        they are, the rest re-quantized to the lo bank in runs of experts as ``grade``
        writes them (lazy)."""
        out = {}
        for n, a in arrays.items():
            b = bank_of(n)
            if b is None:
                out[n] = a
            elif n.endswith(".weight") and b[1] == LO:
                stem = n[: -len(".weight")]
                w, s = a, arrays[f"{stem}.scales"]
                E = w.shape[0]
                hi, lo = self.gmap.hi_ids(b[0]), self.gmap.lo_ids(b[0])
                if hi:
                    rows = mx.array(hi)
                    stem_hi = stem.replace(f".{LO}.", f".{HI}.")
                    out[f"{stem_hi}.weight"], out[f"{stem_hi}.scales"] = w[rows], s[rows]
                runs = expert_runs(lo, max(1, CHUNK_BYTES // (w.nbytes // E)))
                parts = [requantize(w[e : e + k], s[e : e + k], self.lo) for e, k in runs]
                for k, suffix in enumerate(("weight", "scales", "biases")):
                    out[f"{stem}.{suffix}"] = mx.concatenate([p[k] for p in parts])
            elif not n.endswith(".scales"):
                raise CheckpointError(f"{self.base}: {n!r}: not an MXFP4 expert stack")
        return out

    def arrays(self, prefix: str | tuple[str, ...]) -> dict[str, mx.array]:
        return self._lo(self.base.arrays(prefix))

    def model(self, dtype: str = "float32", weights: bool = True) -> nn.Module:
        """The build as a model, lazily; ``weights`` False: unevaluated stand-ins."""
        from k3dist.model import two_bank

        cls = two_bank.build_class(self.config)
        arrays = None
        if weights:
            base = self.base
            arrays = self._lo(
                base.all_arrays() if isinstance(base, SourceView) else base.arrays("")
            )
        return model_from(self.config, arrays, dtype, (cls, kimi_k3.ModelArgs))


class LoView(GradedView):
    """The uniform lo-bank build of ``base`` (every expert in ``lo``), never written: the
    calibration student (module doc)."""

    def __init__(self, base: SourceView | BuildFolder, lo: str | QFormat):
        lo = QFormat.parse(lo) if isinstance(lo, str) else lo
        tc = base.config.get("text_config", base.config)
        super().__init__(base, GradedMap(tc["num_experts"], {}, {}, False, lo.name), lo)
        self.manifest["view"] = "lo"

    def __str__(self) -> str:
        return f"{self.base} as its uniform {self.lo.name} build"
