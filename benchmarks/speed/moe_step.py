"""One MoE layer's decode step on one rank of N: the cost of non-owned pairs.

    python benchmarks/speed/moe_step.py [--preset bench] [--size 2] [--trials 50]

Times, in one process and interleaved (so drift cancels), the expert part of a
decode step (batch 1) on rank 0 of ``size``:
  all       - every routed pair computed (N = 1, mlx-lm's computation)
  placeholder - as implemented, sync-free: non-owned pairs on local expert 0, zeroed
  local     - as implemented, host sync: only owned pairs gathered, computed, scattered
  owned     - lower bound: the owned pairs alone, indices known in advance
No collective runs here: this is compute only (see benchmarks/speed/ep_decode.py for comms).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import k3dist
from k3dist.bench import record
from k3dist.factory import synth
from k3dist.format import layout, placement
from k3dist.model.experts import ExpertParallelMoE

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
from mlx_lm.models import kimi_k3
from mlx_lm.models.switch_layers import SwitchGLU


def build_layer(tc: dict, table: np.ndarray, form: str, seed: int) -> ExpertParallelMoE:
    mx.random.seed(seed)
    args = kimi_k3.TextArgs.from_dict(tc)
    m = ExpertParallelMoE(args, table, None, form)
    nn.quantize(m.switch_mlp, 32, 4, mode="mxfp4")
    m.set_dtype(mx.float32)
    mx.eval(m.parameters())
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench", choices=sorted(synth.PRESETS))
    ap.add_argument("--size", type=int, default=2)
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--blas-threads", type=int)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.blas_threads:
        k3dist.set_blas_threads(args.blas_threads)

    cfg = synth.make_config(synth.PRESETS[args.preset], 768)
    tc = layout.text_config(cfg)
    E, k = tc["num_experts"], tc["num_experts_per_token"]
    layer = 1
    full = placement.contiguous(E, 1, [layer]).local_table(layer, 0)
    mine = placement.contiguous(E, args.size, [layer]).local_table(layer, 0)
    layers = {
        "all": build_layer(tc, full, "placeholder", 0),
        "placeholder": build_layer(tc, mine, "placeholder", 0),
        "local": build_layer(tc, mine, "local", 0),
    }

    rng = np.random.default_rng(0)
    xs = [
        mx.array(rng.normal(size=(1, 1, tc["hidden_size"])).astype(np.float32))
        for _ in range(args.trials)
    ]
    for x in xs:
        mx.eval(x)

    def routed(m: ExpertParallelMoE, x: mx.array, form: str) -> mx.array:
        """The routed step of mlx-lm's forward: switch_mlp, then the weighted sum."""
        inds, w = m._route(x)
        y = m.routed_expert_down_proj(x)
        if form == "owned":  # indices known in advance: only the lower bound
            return SwitchGLU.__call__(m.switch_mlp, y, owned_inds).sum(axis=-2)
        return (m.switch_mlp(y, inds) * w[..., None]).sum(axis=-2)

    owned_inds = mx.array(np.arange(k // args.size, dtype=np.int32)[None, None] % (E // args.size))
    cases = {
        "all": ("all", "placeholder"),
        "placeholder": ("placeholder", "placeholder"),
        "local": ("local", "local"),
        "owned": ("placeholder", "owned"),
    }
    times: dict[str, list[float]] = {c: [] for c in cases}
    for lname, form in cases.values():  # warm-up
        mx.eval(routed(layers[lname], xs[0], form))
    for x in xs:
        for c, (lname, form) in cases.items():
            t = time.perf_counter()
            mx.eval(routed(layers[lname], x, form))
            times[c].append((time.perf_counter() - t) * 1e3)
    med = {c: statistics.median(v) for c, v in times.items()}
    report = {
        "command": record.command_line(),
        "versions": {
            "k3dist": k3dist.__version__,
            "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__,
        },
        "machine": platform.platform(),
        "blas": k3dist.blas_status(),
        "shape": {
            "experts": E,
            "top_k": k,
            "latent": tc["routed_expert_hidden_size"],
            "moe_intermediate": tc["moe_intermediate_size"],
            "size": args.size,
            "activations": "float32",
            "experts_format": "mxfp4",
        },
        "median_ms": {c: round(v, 4) for c, v in med.items()},
        "p90_ms": {c: round(float(np.percentile(v, 90)), 4) for c, v in times.items()},
        "non_owned_cost_ms": {
            "placeholder": round(med["placeholder"] - med["owned"], 4),
            "local": round(med["local"] - med["owned"], 4),
        },
        "trials": args.trials,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
