"""The calibrated speed model (issue 40): the cost model's free terms fitted to published
runs of Kimi K3 on two M3 Ultras (``k3dist.bench.speedfit``), the residual and the
leave-one-out error per point, and k3dist's default build projected with the fitted
terms: decode at batch 1/4/8 and 2K/32K/128K, prefill and time to first token at
2K/8K/20K/64K, for EP (attention split) over ring and JACCL and mlx-lm's TP and PP on the
same build, each row with its dominant term; the goals checked, the terms that stand in
their way and the ranked changes that would close the gap, alone and together; the
shipped defaults the table chooses (``speed_choices``).

    python benchmarks/speed/published_fit.py --out benchmarks/results/2026-12-06/speed.json

Absolute times are projections of this model, not measurements.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from k3dist.bench import costmodel as cm
from k3dist.bench import speedfit as sf
from k3dist.config.box import Box
from k3dist.factory.synth import real_config
from k3dist.format.folder import REAL_K3_INDEX, read_index
from k3dist.model.forms import METAL_FORM
from k3dist.pipeline import byte_budget
from k3dist.pipeline.accounting import account

sys.path.insert(0, str(Path(__file__).resolve().parent))
import speed_choices as choices  # noqa: E402

DECODE_BATCH = (1, 4, 8)
DECODE_CONTEXT = (2048, 32768, 131072)
PROMPTS = (2048, 8192, 20480, 65536)
SHIPPED = byte_budget.shipped()  # deploy/tb5.yaml
FORM = METAL_FORM if SHIPPED.moe_form == "auto" else SHIPPED.moe_form  # k3dist on Metal
SETUPS = (  # (label, costmodel mode, backend, prefill chunk, MoE form)
    ("k3dist EP (attention split), ring", "ep-split", "ring", SHIPPED.prefill_chunk, FORM),
    ("k3dist EP (attention split), JACCL", "ep-split", "jaccl", SHIPPED.prefill_chunk, FORM),
    ("mlx-lm TP, JACCL", "tp", "jaccl", 2048, "placeholder"),
    ("mlx-lm PP, JACCL", "pp", "jaccl", 2048, "placeholder"),
)
OVERHEADS = {  # which fitted stack's overheads a projection carries
    "stock": "pn-tp",  # mlx 0.32.0 / mlx-lm 0.31.3 as PipeNetwork ran it
    "tuned": "ep4",  # EternaPeptix's forks (compiled model, four rails)
}
GOALS = {"decode_b1_tok_s": 15.0, "prefill_8k_tok_s": 160.0}


def default_plan() -> dict:
    acc = account(real_config(), read_index(REAL_K3_INDEX), str(REAL_K3_INDEX))
    limits = byte_budget.Limits.of(SHIPPED)
    return byte_budget.make_plan(acc, Box(), limits, byte_budget.PlanRequest(ranks=2))


def projection(f: cm.Facts, th: dict, overhead: str) -> list[dict]:
    t = sf.with_terms(th, OVERHEADS[overhead])
    rows = []
    for label, mode, backend, chunk, form in SETUPS:
        for b in DECODE_BATCH:
            for ctx in DECODE_CONTEXT:
                rows.append(
                    {
                        "setup": label,
                        "overhead": overhead,
                        "what": "decode",
                        "batch": b,
                        "context": ctx,
                        **sf.project_decode(f, mode, backend, ctx, b, t, form),
                    }
                )
        for p in PROMPTS:
            rows.append(
                {
                    "setup": label,
                    "overhead": overhead,
                    "what": "prefill",
                    "prompt": p,
                    "chunk": chunk,
                    **sf.project_prefill(f, mode, backend, p, chunk, t, form),
                }
            )
    return rows


def built(f: cm.Facts, th: dict) -> dict:
    """The lever built (issue 40 item 5): the phased MoE form against the placeholder form
    auto ran on Metal before, EP split over JACCL, tuned overheads."""
    t = sf.with_terms(th, "ep4")
    out = {}
    for form in ("placeholder", FORM):
        d = sf.project_decode(f, "ep-split", "jaccl", 2048, 1, t, form)
        p = sf.project_prefill(f, "ep-split", "jaccl", 8192, SHIPPED.prefill_chunk, t, form)
        out[form] = {
            "decode_b1_2k_tok_s": d["tok_s"],
            "prefill_8k_tok_s": p["prefill_tok_s"],
            "prefill_8k_terms_s": p["terms_s"],
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    t0 = time.perf_counter()
    config = real_config()
    fit = sf.report(config)
    th = fit["terms"]
    plan = default_plan()
    prof = cm.plan_profile(plan, "k3dist-default")
    f = cm.facts(config, prof)
    rows = projection(f, th, "stock") + projection(f, th, "tuned")

    def best(what: str, key: str, **kw) -> dict:
        sel = [r for r in rows if r["what"] == what and all(r.get(k) == v for k, v in kw.items())]
        return max(sel, key=lambda r: r[key])

    d1 = best("decode", "tok_s", batch=1, context=2048, overhead="tuned")
    p8 = best("prefill", "prefill_tok_s", prompt=8192, overhead="tuned")
    goals = {
        "decode_b1_tok_s": {
            "goal": GOALS["decode_b1_tok_s"],
            "best_projected": d1["tok_s"],
            "setup": d1["setup"],
            "met": d1["tok_s"] >= GOALS["decode_b1_tok_s"],
        },
        "prefill_8k_tok_s": {
            "goal": GOALS["prefill_8k_tok_s"],
            "best_projected": p8["prefill_tok_s"],
            "setup": p8["setup"],
            "met": p8["prefill_tok_s"] >= GOALS["prefill_8k_tok_s"],
        },
    }
    rep = {
        "command": "python benchmarks/speed/published_fit.py " + " ".join(sys.argv[1:]),
        "what": "projections of the calibrated cost model (k3dist.bench.speedfit), not "
        "measurements",
        "fit": fit,
        "backends": {
            k: {"latency_s": v[0], "bandwidth": v[1], "source": sf.BACKEND_SOURCES[k]}
            for k, v in sf.BACKENDS.items()
        },
        "hardware": {"mem_bw": sf.BW, "flops": sf.PEAK, "sources": cm.SOURCES},
        "not_used": sf.NOT_USED,
        "build": {
            "plan": "python -m k3dist.pipeline.plan --real-k3 defaults (box default budget)",
            "lo": plan["lo"]["format"],
            "expert_bpw": plan["expert_bpw"],
            "promoted_fraction": plan["promoted_fraction"],
            "nonexpert": {c: v["format"] for c, v in plan["nonexpert"].items()},
            "profile": asdict(prof),
        },
        "overheads": {
            k: {"stack": v, "O_s": th[f"O:{v}"], "Op_s": th.get(f"Op:{v}")}
            for k, v in OVERHEADS.items()
        },
        "projection": rows,
        "goals": goals,
        "moe_form": FORM,
        "built": built(f, th),
        "defaults": choices.choose(f, config, th, SHIPPED),
        "levers": choices.levers(config, plan, th, SHIPPED.prefill_chunk, FORM),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    a.out.write_text(json.dumps(rep, indent=1) + "\n")
    for r in fit["anchors"]:
        print(
            f"{r['anchor']:40s} {r['published_tok_s']:8.2f} model {r['model_tok_s']:8.2f} "
            f"res {r['residual']:+.3f} loo {r['loo_error']}"
        )
    print(json.dumps(goals, indent=1))


if __name__ == "__main__":
    main()
