"""Every rank: load its folder in each MoE form, decode a batch of prompts together
(k3dist.bench.greedy.batch_decode) and count the local form's host syncs (calls of
OwnedExperts._local, each reads the routing on the host) in one decode
step at batch 1 and at the full batch. Writes a JSON report per rank."""

from __future__ import annotations

import argparse
import json

from k3dist.bench import greedy
from k3dist.model.experts import ExpertParallelMoE, OwnedExperts
from k3dist.model.group import join
from k3dist.serve import loader, warmup

import mlx.core as mx


def host_syncs_per_step(model, batch: int) -> int:
    layers = [
        layer.mlp.switch_mlp for layer in model.layers if isinstance(layer.mlp, ExpertParallelMoE)
    ]
    assert all(isinstance(m, OwnedExperts) for m in layers)
    calls = [0]
    for m in layers:
        inner = m._local

        def counted(*a, _inner=inner):
            calls[0] += 1
            return _inner(*a)

        m._local = counted
    try:
        cache = model.make_cache()
        mx.eval(model(mx.ones((batch, 1), dtype=mx.int32), cache=cache))
    finally:
        for m in layers:
            del m._local
    return calls[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank-dir", required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", required=True, help="JSON report ({rank} allowed)")
    args = ap.parse_args()
    group = join()
    prompts = json.loads(open(args.prompts).read())
    report = {}
    for form in ("placeholder", "local"):
        model, _, _ = loader.load_rank(
            args.rank_dir.format(rank=group.rank()), group, "float32", form, "size"
        )
        model.chunk_sizes = warmup.chunk_sizes(32)
        res = greedy.batch_decode(model, prompts, args.steps, prefill_step_size=32)
        report[form] = {
            "tokens": [t[: args.steps] for t in res.tokens],
            "steps_timed": len(res.step_seconds),
        }
        if form == "local":
            report[form]["host_syncs"] = {
                b: host_syncs_per_step(model, b) for b in (1, len(prompts))
            }
            report["moe_layers"] = sum(
                isinstance(layer.mlp, ExpertParallelMoE) for layer in model.layers
            )
    with open(args.out.format(rank=group.rank()), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
