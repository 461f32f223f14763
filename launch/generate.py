"""Greedy generation on every rank of an expert-parallel group.

    mlx.launch -n 2 --python .venv/bin/python launch/generate.py --prompt-random 40

Each rank loads its own folder (``rank_dir`` with ``{rank}``), runs prefill and
``--max-tokens`` greedy steps, and (with ``--dump``) saves its tokens and logits so
ranks can be compared with each other and with single-process mlx-lm.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import k3dist
from k3dist.bench import greedy
from k3dist.format import deployment
from k3dist.model.group import join, report
from k3dist.serve import loader

import numpy as np

# what one rank's model takes of the deployment
KEYS = deployment.keys("rank")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    deployment.add_arguments(ap, KEYS)
    ap.add_argument(
        "--count",
        action="store_true",
        help="also report collectives per decode token and bytes held (k3dist.serve.introspect)",
    )
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--prompt-ids", help="comma-separated token ids")
    g.add_argument("--prompt-random", type=int, help="N random base-vocab ids (seeded)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=32, help="greedy steps (default 32)")
    ap.add_argument("--dump", help="write tokens+logits to this .npz ({rank} allowed)")
    args = ap.parse_args()
    dep = deployment.from_args(ap, args, KEYS)
    if dep.blas_threads:
        k3dist.set_blas_threads(dep.blas_threads)
    group = join(dep.ring_connect_s)
    rank = group.rank()
    t0 = time.perf_counter()
    model, config, manifest = loader.load_rank(
        dep.rank_path(rank),
        group,
        dep.dtype,
        dep.moe_form,
        dep.verify,
        attention=dep.attention,
        boxes=dep.boxes,
    )
    t_load = time.perf_counter() - t0
    vocab = config["text_config"]["vocab_size"]
    if args.prompt_ids:
        prompt = [int(t) for t in args.prompt_ids.split(",")]
    else:
        n = args.prompt_random or 16
        prompt = np.random.default_rng(args.seed).integers(0, vocab - 256, size=n).tolist()

    t0 = time.perf_counter()
    tokens, logits = greedy.greedy(model, prompt, args.max_tokens)
    t_gen = time.perf_counter() - t0
    if args.dump:
        path = Path(args.dump.format(rank=rank))
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, tokens=np.array(tokens), logits=logits, prompt=np.array(prompt))
    counts = {}
    if args.count:
        from k3dist.serve import introspect

        counts = {
            "collectives_per_token": introspect.collectives_per_token(model),
            "bytes_held": introspect.bytes_held(model),
        }
    report(
        {
            "rank": rank,
            "size": group.size(),
            **counts,
            "attention": manifest.get("attention"),
            "moe_form": loader.resolve_form(dep.moe_form),
            "build_hash": manifest["build_hash"],
            "load_s": round(t_load, 2),
            "verify": manifest["verify"],
            "generate_s": round(t_gen, 2),
            "tokens": tokens,
        }
    )


if __name__ == "__main__":
    sys.exit(main())
