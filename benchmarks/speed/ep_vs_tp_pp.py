"""k3dist expert parallelism vs mlx-lm's tensor parallel, pipeline and single process.

    mlx.launch -n 2 --python .venv/bin/python benchmarks/speed/ep_vs_tp_pp.py --preset bench \\
        --out benchmarks/results/DATE/compare.json

One run, the same build, prompt and ranks for every mode: k3dist EP with attention
replicated, with a contiguous and a load-aware placement (routing counts from the
single-process model over a calibration prompt), k3dist EP with attention split by
heads (``ep_split``, contiguous: the default deployment), mlx-lm's
``kimi_k3.Model.shard`` (TP) and ``model.language_model.model.pipeline`` (PP), and
mlx-lm's model whole on every rank (single, no collectives). EP, EP-split, TP and PP
also decode batches of ``--batches`` prompts in lockstep (``<mode>@b<B>``; aggregate
tok/s = B / step time). The collectives one decode token issues and the weight bytes
each rank holds are counted from the running models (``counted``). Prefill and decode
are timed in interleaved rounds; EP's
compute is measured with its collectives bypassed, TP/PP communication is estimated
from microbenchmarks (see ``k3dist.bench.compare``). Rank 0 writes the JSON (``--out``) and a
bar chart (``--png``, default: the JSON's name with .png).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from k3dist.bench import builds, compare, record
from k3dist.factory import synth
from k3dist.model.forms import MOE_FORMS
from k3dist.serve import loader


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in compare.PARALLEL if m in report["summary"]]
    s = report["summary"]
    total = [s[m]["decode_step_ms"]["median"] for m in modes]
    comp = [s[m]["split"]["decode_compute_ms"] for m in modes]
    xfer = [s[m]["split"]["decode_transfer_estimated_ms"] or 0.0 for m in modes]
    # EP: measured communication beyond the estimated transfer = waiting/busy-wait
    wait = [
        max(0.0, s[m]["split"]["decode_comm_ms"]["median"] - x) if m.startswith("ep_") else 0.0
        for m, x in zip(modes, xfer, strict=True)
    ]
    lo = [t - s[m]["decode_step_ms"]["p10"] for m, t in zip(modes, total, strict=True)]
    hi = [s[m]["decode_step_ms"]["p90"] - t for m, t in zip(modes, total, strict=True)]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 4.6))
    x = list(range(len(modes)))
    hatch = ["//" if m in ("tp", "pp") else "" for m in modes]
    a.bar(
        x,
        comp,
        color="#4C72B0",
        hatch=hatch,
        edgecolor="white",
        label="compute (EP: measured, collectives bypassed; TP/PP hatched: total - est. "
        "transfer, incl. waiting)",
    )
    a.bar(
        x,
        wait,
        bottom=comp,
        color="#F2B880",
        label="EP: waiting for the peer (measured comm - est. transfer)",
    )
    a.bar(
        x,
        xfer,
        bottom=[c + w for c, w in zip(comp, wait, strict=True)],
        color="#DD8452",
        label="transfer (collective microbenchmark x count)",
    )
    a.errorbar(
        x, total, yerr=[lo, hi], fmt="none", ecolor="black", capsize=3, label="step time p10-p90"
    )
    for i, m in enumerate(modes):
        a.text(
            i,
            total[i] + hi[i],
            f"{s[m]['decode_tok_s']:.1f} tok/s",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    a.set_xticks(x, modes, rotation=15)
    a.set_ylabel("decode step, batch 1 (ms, median)")
    a.set_title("Decode step (per box, rank 0)")
    a.legend(fontsize=6, loc="upper left")
    a.set_ylim(0, max(t + h for t, h in zip(total, hi, strict=True)) * 1.45)
    b.bar(x, [s[m]["prefill_tok_s"] for m in modes], color="#55A868")
    b.set_xticks(x, modes, rotation=15)
    b.set_ylabel(f"prefill tok/s ({report['settings']['prompt_len']}-token prompt)")
    b.set_title("Prefill")
    batches = sorted({v.get("batch", 1) for v in s.values()})
    width = 0.8 / max(1, len(batches))
    for j, B in enumerate(batches):
        names = [compare.batch_name(m, B) for m in compare.BATCHED]
        c.bar(
            [i + j * width for i in range(len(names))],
            [s[n]["decode_tok_s_aggregate"] if n in s else 0.0 for n in names],
            width,
            label=f"batch {B}",
        )
    c.set_xticks(
        [i + width * (len(batches) - 1) / 2 for i in range(len(compare.BATCHED))],
        compare.BATCHED,
        rotation=15,
    )
    c.set_ylabel("decode tok/s, all requests together")
    c.set_title("Batched decode (lockstep)")
    c.legend(fontsize=7)
    r = report["ratios"]
    end = report["ranks"][0]["environment"]["loadavg"][0]
    fig.suptitle(
        f"{report['model']['num_hidden_layers']}-layer K3 "
        f"({report['model']['num_experts']} experts), {report['size']} ranks, "
        f"{report['backend']['device']} {report['settings']['dtype']}, load average "
        f"{report['loadavg'][0]}->{end}; EP speed over TP "
        f"{r.get('ep_over_tp_decode', float('nan')):.2f}x, PP "
        f"{r.get('ep_over_pp_decode', float('nan')):.2f}x, single "
        f"{r.get('ep_over_single_decode', float('nan')):.2f}x (decode)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument(
        "--preset",
        choices=sorted(synth.PRESETS),
        help="synthesize + convert into --cache-dir (reused); default bench",
    )
    src.add_argument("--build", help="an MLX build folder (python -m k3dist.pipeline.convert)")
    ap.add_argument("--cache-dir", default="runs", help="where --preset builds live")
    d = compare.CompareSettings()
    ap.add_argument("--prompt-len", type=int, default=d.prompt_len)
    ap.add_argument("--prefill-rounds", type=int, default=d.prefill_rounds)
    ap.add_argument("--decode-rounds", type=int, default=d.decode_rounds)
    ap.add_argument("--steps-per-round", type=int, default=d.steps_per_round)
    ap.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    ap.add_argument(
        "--calib-len",
        type=int,
        default=d.calib_len,
        help="calibration prompt for the load-aware placement's routing counts",
    )
    ap.add_argument("--comm-trials", type=int, default=d.comm_trials)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument(
        "--batches",
        type=int,
        nargs="+",
        default=list(d.batches),
        help="decode batch sizes (1 must be among them)",
    )
    ap.add_argument("--dtype", default=d.dtype, choices=sorted(loader.DTYPES))
    ap.add_argument("--moe-form", default=d.moe_form, choices=("auto", *MOE_FORMS))
    record.add_rank_args(ap)
    ap.add_argument("--tmp", help="where the per-rank slices are written (removed after)")
    ap.add_argument("--out", help="JSON report (rank 0); stdout always gets it")
    ap.add_argument("--png", help="bar chart (default: --out with .png)")
    args = ap.parse_args()

    group, launcher = record.start_rank(args)
    if group.size() < 2:
        raise SystemExit("ep_vs_tp_pp.py needs at least 2 ranks: run it under mlx.launch -n 2")
    build = (
        Path(args.build)
        if args.build
        else builds.ensure_preset_build(args.preset or "bench", args.cache_dir)
    )
    s = compare.CompareSettings(
        prompt_len=args.prompt_len,
        prefill_rounds=args.prefill_rounds,
        decode_rounds=args.decode_rounds,
        steps_per_round=args.steps_per_round,
        warmup_steps=args.warmup_steps,
        calib_len=args.calib_len,
        comm_trials=args.comm_trials,
        seed=args.seed,
        dtype=args.dtype,
        moe_form=args.moe_form,
        batches=tuple(args.batches),
    )
    if 1 not in s.batches:
        raise SystemExit("--batches must include 1 (the baseline of every ratio)")
    env = record.environment()
    mine = compare.compare(
        build, group, s, args.tmp, log=lambda m: print(m, file=sys.stderr, flush=True)
    )
    mine["environment"] = record.environment()  # per rank: its machine, load after the run
    reports = record.gather_json(mine, group)
    if group.rank() != 0:
        return
    report = compare.merge_compare(reports, env, build)
    report["preset"] = args.preset if not args.build else None
    report["launcher_reniced"] = bool(args.nice_launcher and launcher)
    text = json.dumps(report, indent=1)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        plot(report, Path(args.png) if args.png else out.with_suffix(".png"))
    elif args.png:
        plot(report, Path(args.png))
    print(text, flush=True)


if __name__ == "__main__":
    main()
