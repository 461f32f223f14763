"""Decode benchmark of an expert-parallel deployment, per box (every rank reports).

    mlx.launch -n 2 --python .venv/bin/python benchmarks/speed/ep_decode.py --preset bench \\
        --out benchmarks/results/DATE/decode.json

Each rank: prefill tok/s at several prompt lengths; decode step time and tok/s
(batch 1); the step split into compute (the same steps with the MoE all_sum
bypassed) and communication (the rest), the all_sums per step and an all_sum
microbenchmark at the step's payload; peak memory. Rank 0 writes every rank's
report to ``--out`` (and stdout).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from k3dist.bench import builds, decode, record
from k3dist.factory import synth
from k3dist.model.forms import MOE_FORMS
from k3dist.pipeline import slicing
from k3dist.serve import loader


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--rank-dir", help="existing rank folders, a pattern with {rank}")
    src.add_argument("--build", help="an MLX build, sliced per rank into a temp folder")
    src.add_argument(
        "--preset",
        choices=sorted(synth.PRESETS),
        help="synthesize + convert into --cache-dir (reused), then slice",
    )
    ap.add_argument("--cache-dir", default="runs")
    ap.add_argument("--size", type=int, help="ranks the build is sliced for (= the group)")
    ap.add_argument("--placement-counts", help="routing counts (.npz/.json): load-aware")
    ap.add_argument("--moe-form", default="auto", choices=("auto", *MOE_FORMS))
    ap.add_argument("--dtype", default="float32", choices=sorted(loader.DTYPES))
    d = decode.DecodeSettings()
    ap.add_argument("--prompt-lens", default=",".join(map(str, d.prompt_lens)))
    ap.add_argument("--prefill-trials", type=int, default=d.prefill_trials)
    ap.add_argument(
        "--context-len",
        type=int,
        default=d.context_len,
        help="tokens in the cache before the timed decode steps",
    )
    ap.add_argument("--trials", type=int, default=d.decode_trials, help="decode steps timed")
    ap.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    ap.add_argument("--comm-trials", type=int, default=d.comm_trials)
    ap.add_argument("--seed", type=int, default=d.seed)
    record.add_rank_args(ap)
    ap.add_argument("--out", help="JSON report of every rank (written by rank 0)")
    args = ap.parse_args()

    group, launcher = record.start_rank(args)
    rank, size = group.rank(), group.size()
    if args.size is not None and args.size != size:
        raise SystemExit(
            f"--size {args.size} but mlx.launch started {size} ranks; launch "
            f"with -n {args.size} (or a hostfile of {args.size} hosts)"
        )
    s = decode.DecodeSettings(
        prompt_lens=tuple(int(x) for x in args.prompt_lens.split(",")),
        prefill_trials=args.prefill_trials,
        context_len=args.context_len,
        decode_trials=args.trials,
        warmup_steps=args.warmup_steps,
        comm_trials=args.comm_trials,
        seed=args.seed,
    )
    env = record.environment()
    with tempfile.TemporaryDirectory(prefix="k3dist-decode-") as tmp:
        if args.rank_dir:
            folder = Path(args.rank_dir.format(rank=rank))
        else:
            build = (
                Path(args.build)
                if args.build
                else builds.ensure_preset_build(args.preset or "bench", args.cache_dir)
            )
            plc = slicing.placement_for(build, size, args.placement_counts)
            folder = builds.slice_for_rank(build, tmp, group, plc)
        model, config, manifest = loader.load_rank(folder, group, args.dtype, args.moe_form)
    mine = decode.decode_report(model, group, config["text_config"]["vocab_size"], s)
    mine.update(
        environment=env,
        folder=record.repo_path(folder),
        build_hash=manifest["build_hash"],
        placement={"kind": manifest["placement"].get("kind"), "hash": manifest["placement_hash"]},
        moe_form=loader.resolve_form(args.moe_form),
        dtype=args.dtype,
        launcher={**launcher, "reniced": args.nice_launcher} if launcher else None,
    )
    reports = record.gather_json(mine, group)
    if rank != 0:
        return
    report = {**env, "size": size, "ranks": reports}
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    sys.exit(main())
