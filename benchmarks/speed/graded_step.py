"""Decode step of one graded (two-bank) MoE layer vs single-bank, side by side.

    python benchmarks/speed/graded_step.py [--preset bench] [--promoted 0.1] [--k-hi 2,4]

Times, in one process and interleaved (so drift cancels), one token (batch 1) through
one MoE layer on rank 0 of ``--size`` (no collective runs: compute only), for:

  single-lo     single bank, every expert affine low-bit (the uniform build)
  single-mxfp4  single bank, every expert MXFP4 (the source build)
  graded-kN     two banks: lo affine low-bit + ``--promoted`` of the experts MXFP4,
                hi bank capped at N routes per token (``k_hi``), no fallback copy

each as the whole layer (router, latent projections, shared experts, routed experts)
and as the routed experts alone. Goal (issue 12): graded <= 1.2x single-lo.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import k3dist
from k3dist.bench import record
from k3dist.factory import synth
from k3dist.format import layout, placement
from k3dist.format.qformat import QFormat
from k3dist.model import two_bank
from k3dist.model.experts import ExpertParallelMoE

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
from mlx_lm.models import kimi_k3


def _quantize(m: nn.Module, bank: str, fmt: QFormat) -> None:
    nn.quantize(
        getattr(m, bank), class_predicate=lambda p, _: p.endswith("_proj") and fmt.qconfig()
    )


def build(
    tc: dict, size: int, form: str, lo: QFormat, hi_ids: list[int] | None, k_hi: int
) -> ExpertParallelMoE:
    mx.random.seed(0)
    args = kimi_k3.TextArgs.from_dict(tc)
    E = tc["num_experts"]
    owners = np.asarray(placement.contiguous(E, size, [1]).owners[1])
    if hi_ids is None:
        table = np.where(owners == 0, np.cumsum(owners == 0) - 1, -1).astype(np.int32)
        m = ExpertParallelMoE(args, table, None, form)
    else:
        m = two_bank.TwoBankMoE(args, owners, 0, None, form, hi_ids, k_hi, False)
        _quantize(m, "switch_hi", QFormat.parse("mxfp4"))
    _quantize(m, "switch_mlp", lo)
    m.set_dtype(mx.float32)
    mx.eval(m.parameters())
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench", choices=sorted(synth.PRESETS))
    ap.add_argument("--size", type=int, default=1, help="time rank 0 of this many")
    ap.add_argument("--form", default="placeholder", choices=("placeholder", "local"))
    ap.add_argument("--lo", default="2bit-g64")
    ap.add_argument("--promoted", type=float, default=0.1, help="fraction of experts on hi")
    ap.add_argument("--k-hi", default="2,4", help="comma-separated k_hi values")
    ap.add_argument("--trials", type=int, default=60)
    ap.add_argument("--blas-threads", type=int)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.blas_threads:
        k3dist.set_blas_threads(args.blas_threads)

    tc = layout.text_config(synth.make_config(synth.PRESETS[args.preset], 768))
    E, k = tc["num_experts"], tc["num_experts_per_token"]
    lo = QFormat.parse(args.lo)
    n_hi = max(args.size, round(args.promoted * E) // args.size * args.size)
    # spread over the ranks' contiguous ranges so rank 0 holds its share
    hi_ids = sorted(int(e) for e in np.linspace(0, E - 1, n_hi).round())
    layers = {
        "single-lo": build(tc, args.size, args.form, lo, None, 0),
        "single-mxfp4": build(tc, args.size, args.form, QFormat.parse("mxfp4"), None, 0),
    }
    for kh in (int(v) for v in args.k_hi.split(",")):
        layers[f"graded-k{kh}"] = build(tc, args.size, args.form, lo, hi_ids, kh)

    rng = np.random.default_rng(0)
    xs = [
        mx.array(rng.normal(size=(1, 1, tc["hidden_size"])).astype(np.float32))
        for _ in range(args.trials)
    ]
    mx.eval(xs)

    def routed(m: ExpertParallelMoE, x: mx.array) -> mx.array:
        inds, w = m._route(x)
        y = m.routed_expert_down_proj(x)
        if not isinstance(m, two_bank.TwoBankMoE):  # mlx-lm's routed step
            return (m.switch_mlp(y, inds) * w[..., None]).sum(axis=-2)
        if args.form == "local":
            return m._routed_local(y, inds, w)
        return m._routed_placeholder(y, inds, w)

    fns = {"layer": lambda m, x: m(x), "routed": routed}
    times = {(p, n): [] for p in fns for n in layers}
    for p, n in times:  # warm-up
        mx.eval(fns[p](layers[n], xs[0]))
    for x in xs:
        for p, n in times:
            t = time.perf_counter()
            mx.eval(fns[p](layers[n], x))
            times[(p, n)].append((time.perf_counter() - t) * 1e3)
    med = {f"{p}/{n}": statistics.median(v) for (p, n), v in times.items()}
    ratio = {f"{p}/{n}": round(med[f"{p}/{n}"] / med[f"{p}/single-lo"], 3) for (p, n) in times}
    argv = [a if not a.startswith("/") else Path(a).name for a in sys.argv[1:]]
    report = {
        "command": "python benchmarks/speed/graded_step.py "
        + " ".join(shlex.quote(a) for a in argv),
        "versions": {
            "k3dist": k3dist.__version__,
            "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__,
        },
        "machine": platform.platform(),
        "blas": k3dist.blas_status(),
        "device": str(mx.default_device()),
        "shape": {
            "preset": args.preset,
            "experts": E,
            "top_k": k,
            "latent": tc["routed_expert_hidden_size"],
            "moe_intermediate": tc["moe_intermediate_size"],
            "size": args.size,
            "form": args.form,
            "activations": "float32",
            "lo": lo.name,
            "hi": "mxfp4",
            "promoted": n_hi,
            "tokens": 1,
        },
        "median_ms": {c: round(v, 4) for c, v in med.items()},
        "p90_ms": {
            f"{p}/{n}": round(float(np.percentile(v, 90)), 4) for (p, n), v in times.items()
        },
        "ratio_vs_single_lo": ratio,
        "goal": "graded <= 1.2x single-lo",
        "trials": args.trials,
    }
    record.emit(report, args.out)


if __name__ == "__main__":
    main()
