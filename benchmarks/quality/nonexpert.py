"""Non-expert precision by measurement (issue 12, point 3): on the trained mini-K3, one
non-expert tensor class at a time is quantized affine 8 / 6 / 5 / 4-bit (group 64; the
converter drops to group 32 where a matrix's columns are not a multiple of 64: the
mini-K3's MLA ``q_b_proj`` / ``o_proj`` / ``embed_q`` and latent ``routed_expert_up_proj``
have 96 or 32 columns), every other tensor in its source dtype and the routed experts in
their MXFP4 source bytes, and compared with the MXFP4 teacher (``k3dist.bench.evaluate``:
KL(teacher || student), top-1 flip, per-domain perplexity on the held-out windows).

Classes are ``k3dist.format.classes.CLASSES``: the router is among them because mlx-lm's
``kimi_k3`` ``quant_predicate`` quantizes it (8-bit g64); AttnRes projections it never
quantizes (they stay in the ``small`` class, source dtype). Combined rows follow: every
class at 6 and at 4 bits, the planner's ``DEFAULT_NONEXPERT``, and ``measured-T<tol>``:
what ``python -m k3dist.pipeline.plan --nonexpert-sensitivity`` picks from these rows at the
KL tolerance, built and measured whole (is KL additive across classes?).

Builds (``python -m k3dist.pipeline.convert --nonexpert CLASS=FORMAT``) are reused under
``runs/nonexpert/``; the teacher is ``runs/mxfp4`` (built when missing).

    python benchmarks/quality/nonexpert.py --windows 8 --out benchmarks/results/DATE/nonexpert.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from k3dist.format.classes import CLASSES, module_class
from k3dist.format.folder import REAL_K3_CONFIG, REAL_K3_INDEX, weight_map
from k3dist.format.layout import ATTENTION_MODES
from k3dist.format.sfile import read_header
from k3dist.pipeline import convert
from k3dist.pipeline.byte_budget import DEFAULT_KL_TOLERANCE, DEFAULT_NONEXPERT, measured_nonexpert

PY = sys.executable
SRC = Path("k3dist/data/mini-k3")
RUNS = Path("runs/nonexpert")
BITS = (8, 6, 5, 4)
GROUP = 64


def class_bytes(build: Path) -> dict[str, int]:
    """Bytes per class of every non-expert tensor of a build (weights, scales, biases)."""
    index = weight_map(build)
    out: dict[str, int] = {}
    for f in dict.fromkeys(index.values()):
        for name, t in read_header(build / f).tensors.items():
            module = name.rsplit(".", 1)[0]
            try:
                c = module_class(module)
            except ValueError:
                c = "small"  # norms, biases, convs, A_log, dt_bias
            if c in CLASSES:
                out[c] = out.get(c, 0) + t.nbytes
    return out


def evaluate(
    a: argparse.Namespace, students: list[tuple[str, Path]], raw: Path
) -> tuple[dict, list[str]]:
    """``k3dist.bench.evaluate`` of ``students`` (name, build) against the teacher;
    its JSON is reused while it holds exactly these students."""
    cmd = [
        "k3dist.bench.evaluate",
        "--teacher",
        str(a.teacher),
        "--windows",
        str(a.windows),
        "--seq",
        str(a.seq),
        "--out",
        str(raw),
    ]
    for name, build in students:
        cmd += ["--student", str(build), "--name", name]
    names = {n for n, _ in students}
    if not raw.exists() or {r["build"] for r in json.loads(raw.read_text())["rows"]} != names:
        print("+ python -m", " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run([PY, "-m", *cmd], check=True)
    return json.loads(raw.read_text()), cmd


def students() -> list[tuple[str, str, dict[str, str]]]:
    """(name, class or 'all', per-class formats) of every student build."""
    rows = [(f"{c}-{b}bit", c, {c: f"{b}bit-g{GROUP}"}) for c in CLASSES for b in BITS]
    rows.append(("all-6bit", "all", {c: f"6bit-g{GROUP}" for c in CLASSES}))
    rows.append(("all-4bit", "all", {c: f"4bit-g{GROUP}" for c in CLASSES}))
    rows.append(("default", "all", dict(DEFAULT_NONEXPERT)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=8, help="held-out windows per domain")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--teacher", type=Path, default=Path("runs/mxfp4"))
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--markdown", type=Path, help="default: --out with .md")
    ap.add_argument(
        "--plan-k3",
        type=Path,
        help="also write the real-K3 plan (2 ranks) with "
        "the measured formats, attention replicated and split, vs the defaults",
    )
    ap.add_argument(
        "--kl-tolerance",
        type=float,
        default=None,
        help="the planner's tolerance for the 'measured' row and --plan-k3 "
        f"(default {DEFAULT_KL_TOLERANCE})",
    )
    a = ap.parse_args()
    convert.convert(SRC, a.teacher, progress=False)  # reused when complete
    rows = students()
    builds = {}
    for name, _, spec in rows:
        builds[name] = convert.convert(SRC, RUNS / name, progress=False, nonexpert=spec)
    raw = RUNS / f"evaluate-w{a.windows}-s{a.seq}.json"
    rep, cmd = evaluate(a, [(n, builds[n]) for n, _, _ in rows], raw)
    teacher_bytes = class_bytes(a.teacher)

    def row(name: str, cls: str, spec: dict, r: dict) -> dict:
        man = json.loads((builds[name] / "k3dist.json").read_text())
        cb = class_bytes(builds[name])
        return {
            "build": name,
            "class": cls,
            "format": spec[cls] if cls in CLASSES else spec,
            "formats_used": man["profile"]["nonexpert_modules"],
            "kl": r["kl"],
            "flip": r["flip"],
            "ppl": r["ppl"],
            "kl_by_domain": r["kl_by_domain"],
            "class_bytes": cb.get(cls) if cls in CLASSES else sum(cb.values()),
            "class_bytes_source": teacher_bytes.get(cls)
            if cls in CLASSES
            else sum(teacher_bytes.values()),
            "nonexpert_bytes": sum(cb.values()),
        }

    by_name = {r["build"]: r for r in rep["rows"]}
    table = [row(name, cls, spec, by_name[name]) for name, cls, spec in rows]
    # the planner's pick at the tolerance, built and measured whole
    tol = a.kl_tolerance if a.kl_tolerance is not None else DEFAULT_KL_TOLERANCE
    sens: dict = {}
    for r in table:
        if r["class"] in CLASSES:
            sens.setdefault(r["class"], {})[r["format"]] = r["kl"]
    picked, origin = measured_nonexpert(sens, tol)
    mname = f"measured-T{tol}"
    builds[mname] = convert.convert(SRC, RUNS / mname, progress=False, nonexpert=picked)
    mrep, mcmd = evaluate(
        a, [(mname, builds[mname])], RUNS / f"evaluate-{mname}-w{a.windows}-s{a.seq}.json"
    )
    table.append(
        {
            **row(mname, "measured", picked, mrep["rows"][0]),
            "kl_tolerance": tol,
            "from": origin,
            "sum_of_class_kls": round(
                sum(sens[c].get(f, 0.0) for c, f in picked.items() if c in sens), 6
            ),
        }
    )
    result = {
        "command": "python benchmarks/quality/nonexpert.py " + " ".join(sys.argv[1:]),
        "evaluate_commands": ["python -m " + " ".join(cmd), "python -m " + " ".join(mcmd)],
        "teacher": rep["teacher"],
        "windows_per_domain": rep["windows_per_domain"],
        "seq": rep["seq"],
        "tokens_per_domain": rep["tokens_per_domain"],
        "group_size": GROUP,
        "group_rule": "g64; g32 where a matrix's columns are not a multiple of 64 "
        "(formats_used counts the modules of each)",
        "classes_source_bytes": teacher_bytes,
        "rows": table,
        "seconds": rep["seconds"],
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    md = a.markdown or a.out.with_suffix(".md")
    md.write_text(markdown(result))
    if a.plan_k3:
        plan_k3(a.out, a.plan_k3, a.kl_tolerance)
    print(json.dumps(result, indent=1))


K3 = (
    "--config",
    str(REAL_K3_CONFIG),
    "--index",
    str(REAL_K3_INDEX),
    "--ranks",
    "2",
    "--dry-run",
    "--json",
)


def plan_k3(sens: Path, out: Path, tolerance: float | None) -> dict:
    """The real-K3 plan with measured non-expert formats, attention replicated and
    split, beside the default formats' plan: non-expert bytes each decoded token reads
    per rank (every non-expert byte but one embedding row) and promoted experts."""
    res: dict = {
        "command": "python benchmarks/quality/nonexpert.py " + " ".join(sys.argv[1:]),
        "commands": [],
        "plans": {},
        "compare": {},
        "change": {},
    }
    for attention in ATTENTION_MODES:
        for name, extra in (("default", ()), ("measured", ("--nonexpert-sensitivity", str(sens)))):
            if tolerance is not None and name == "measured":
                extra = (*extra, "--kl-tolerance", str(tolerance))
            tmp = RUNS / f"plan-k3-{attention}-{name}.json"
            cmd = ["k3dist.pipeline.plan", *K3, "--attention", attention, *extra, "--out", str(tmp)]
            subprocess.run([PY, "-m", *cmd], check=True, capture_output=True)
            p = json.loads(tmp.read_text())
            key = f"{attention}-{name}"
            res["commands"].append(p["command"])
            if name == "measured":
                res["plans"][attention] = p
            res["compare"][key] = {
                "nonexpert_formats": {c: v["format"] for c, v in p["nonexpert"].items()},
                "nonexpert_per_rank": p["bytes_per_rank"]["nonexpert"],
                "nonexpert_read_per_token_per_rank": p["nonexpert_read_per_token_per_rank"],
                "promoted_total": p["promoted_total"],
                "expert_bpw": p["expert_bpw"],
                "lo": p["lo"]["format"],
                "headroom_per_rank": p["headroom_per_rank"],
            }
    for attention in ATTENTION_MODES:
        d, m = res["compare"][f"{attention}-default"], res["compare"][f"{attention}-measured"]
        res["change"][attention] = {
            k: {"default": d[k], "measured": m[k], "ratio": round(m[k] / d[k], 4)}
            for k in ("nonexpert_per_rank", "nonexpert_read_per_token_per_rank", "promoted_total")
        }
    out.write_text(json.dumps(res, indent=1) + "\n")
    return res


def markdown(res: dict) -> str:
    doms = list(res["teacher"]["ppl"])
    t = res["teacher"]
    lines = [
        f"Non-expert precision, one class at a time (others bf16, experts MXFP4), vs the "
        f"teacher `{t['build']}`; {res['windows_per_domain']} held-out windows x "
        f"{res['seq']} tokens per domain. `{res['command']}`",
        "",
        "| build | class | KL (nats/token) | top-1 flip | "
        + " | ".join(f"{d} ppl" for d in doms)
        + " | class bytes (bf16 bytes) |",
        "|---|---|---:|---:|" + "---:|" * len(doms) + "---:|",
        "| teacher | - | 0 | 0 | " + " | ".join(f"{t['ppl'][d]:.3f}" for d in doms) + " | - |",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['build']} | {r['class']} | {r['kl']:.5f} | {r['flip']:.4f} | "
            + " | ".join(f"{r['ppl'][d]:.3f}" for d in doms)
            + f" | {r['class_bytes']:,} ({r['class_bytes_source']:,}) |"
        )
    for r in res["rows"]:
        if "kl_tolerance" in r:
            lines += [
                "",
                f"`{r['build']}` (fewest bits with KL <= {r['kl_tolerance']}): "
                + ", ".join(f"{c} {f}" for c, f in r["format"].items())
                + f"; sum of the per-class KLs {r['sum_of_class_kls']:.5f}, measured "
                f"whole {r['kl']:.5f}.",
            ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
