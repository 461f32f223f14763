"""Generation on a (possibly expert-parallel) K3: mlx-lm's ``generate_step`` drives
prefill and decode; every rank runs the same steps in lockstep because every rank
computes the same logits and samples the same token.

:func:`main` is ``launch/generate.py``: each rank loads its own folder (``rank_dir``
with ``{rank}``), runs prefill and ``--max-tokens`` greedy steps, and (with ``--dump``)
saves its tokens and logits so ranks can be compared with each other and with
single-process mlx-lm."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import k3dist
from k3dist.config import deployment
from k3dist.model.group import join, report
from k3dist.serve import loader

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step


def greedy(
    model, prompt: list[int], steps: int, prefill_step_size: int = 2048
) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and the raw logits behind each of them ([steps, vocab], float32)."""
    seen: list[mx.array] = []

    def capture(_tokens: mx.array, logits: mx.array) -> mx.array:
        seen.append(logits)
        return logits

    tokens = [
        int(tok)
        for tok, _ in generate_step(
            mx.array(prompt),
            model,
            max_tokens=steps,
            logits_processors=[capture],
            prefill_step_size=prefill_step_size,
        )
    ]
    logits = np.stack([np.array(x.reshape(-1), dtype=np.float32) for x in seen[:steps]])
    return tokens, logits


@dataclass
class BatchDecode:
    """What :func:`batch_decode` returns: each prompt's greedy tokens (``steps`` or more)
    and the seconds of each of the ``steps`` decode steps run with the whole batch."""

    tokens: list[list[int]]
    step_seconds: list[float]


def batch_decode(
    model, prompts: list[list[int]], steps: int, prefill_step_size: int = 2048
) -> BatchDecode:
    """Decode ``prompts`` together, greedy, through mlx-lm's BatchGenerator as the server
    runs it (prefill one prompt at a time, decode all of them in one batch). Every rank
    of an expert-parallel model calls it with the same prompts and runs the same steps
    in lockstep. Steps that still prefill a prompt are not timed: ``step_seconds`` holds
    ``steps`` steps that decode the whole batch and nothing else."""
    from mlx_lm.generate import BatchGenerator

    B = len(prompts)
    if B < 1 or steps < 1:
        raise ValueError(f"batch_decode needs at least one prompt and one step, not {B}, {steps}")
    gen = BatchGenerator(
        model, completion_batch_size=B, prefill_batch_size=1, prefill_step_size=prefill_step_size
    )
    # Enough tokens that no prompt ends before ``steps`` whole-batch steps were timed:
    # the first prompt decodes while the others are prefilled.
    limit = steps + sum(len(p) // prefill_step_size + 2 for p in prompts)
    uids = gen.insert(prompts, max_tokens=[limit] * B)
    out: dict[int, list[int]] = {u: [] for u in uids}
    times: list[float] = []
    try:
        while len(times) < steps:
            t0 = time.perf_counter()
            prompt_responses, responses = gen.next()
            dt = time.perf_counter() - t0
            for r in responses:
                out[r.uid].append(r.token)
            if len(responses) == B and not prompt_responses:
                times.append(dt)
            if not responses and not prompt_responses:
                raise RuntimeError(
                    f"batch_decode: the batch ended before {steps} whole-batch steps"
                )
    finally:
        gen.close()
    return BatchDecode([out[u] for u in uids], times)


# what one rank's model takes of the deployment
KEYS = deployment.keys("rank")


def main() -> None:
    ap = argparse.ArgumentParser(
        description="Greedy generation on every rank of an expert-parallel group"
    )
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
    model, config, manifest = loader.load_deployed(dep, group)
    t_load = time.perf_counter() - t0
    vocab = config["text_config"]["vocab_size"]
    if args.prompt_ids:
        prompt = [int(t) for t in args.prompt_ids.split(",")]
    else:
        n = args.prompt_random or 16
        prompt = np.random.default_rng(args.seed).integers(0, vocab - 256, size=n).tolist()

    t0 = time.perf_counter()
    tokens, logits = greedy(model, prompt, args.max_tokens)
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
    main()
