"""Non-expert precision by measurement (issue 12, point 3): on the trained mini-K3, one
non-expert tensor class at a time is quantized affine 8 / 6 / 5 / 4-bit (group 64; the
converter drops to group 32 where a matrix's columns are not a multiple of 64: the
mini-K3's MLA ``q_b_proj`` / ``o_proj`` / ``embed_q`` and latent ``routed_expert_up_proj``
have 96 or 32 columns), every other tensor in its source dtype and the routed experts in
their MXFP4 source bytes, and compared with the MXFP4 teacher (``k3dist.bench.evaluate``:
KL(teacher || student), top-1 flip, per-domain perplexity on the held-out windows).

Classes are ``k3dist.build.plan.CLASSES``: the router is among them because mlx-lm's
``kimi_k3`` ``quant_predicate`` quantizes it (8-bit g64); AttnRes projections it never
quantizes (they stay in the ``small`` class, source dtype). Three combined rows follow:
every class at 6 and at 4 bits, and the planner's ``DEFAULT_NONEXPERT``.

Builds (``python -m k3dist.build.convert --nonexpert CLASS=FORMAT``) are reused under
``runs/nonexpert/``; the teacher is ``runs/mxfp4`` (built when missing).

    python benchmarks/nonexpert.py --windows 8 --out benchmarks/results/nonexpert-DATE.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from k3dist.build import convert
from k3dist.build.checkpoint import INDEX_NAME
from k3dist.build.plan import CLASSES, DEFAULT_NONEXPERT, module_class
from k3dist.format.sfile import read_header

PY = sys.executable
SRC = Path("data/mini-k3")
RUNS = Path("runs/nonexpert")
BITS = (8, 6, 5, 4)
GROUP = 64


def class_bytes(build: Path) -> dict[str, int]:
    """Bytes per class of every non-expert tensor of a build (weights, scales, biases)."""
    index = json.loads((build / INDEX_NAME).read_text())["weight_map"]
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


def students() -> list[tuple[str, str, dict[str, str]]]:
    """(name, class or 'all', per-class formats) of every student build."""
    rows = [
        (f"{c}-{b}bit", c, {c: f"{b}bit-g{GROUP}"}) for c in CLASSES for b in BITS
    ]
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
    a = ap.parse_args()
    convert.convert(SRC, a.teacher, progress=False)  # reused when complete
    rows = students()
    builds = {}
    for name, _, spec in rows:
        builds[name] = convert.convert(SRC, RUNS / name, progress=False, nonexpert=spec)
    raw = RUNS / f"evaluate-w{a.windows}-s{a.seq}.json"
    cmd = ["k3dist.bench.evaluate", "--teacher", str(a.teacher), "--windows",
           str(a.windows), "--seq", str(a.seq), "--out", str(raw)]
    for name, _, _ in rows:
        cmd += ["--student", str(builds[name]), "--name", name]
    if not raw.exists() or {r["build"] for r in json.loads(raw.read_text())["rows"]} != {
            n for n, _, _ in rows}:
        print("+ python -m", " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run([PY, "-m", *cmd], check=True)
    rep = json.loads(raw.read_text())
    teacher_bytes = class_bytes(a.teacher)
    by_name = {r["build"]: r for r in rep["rows"]}
    table = []
    for name, cls, spec in rows:
        r = by_name[name]
        man = json.loads((builds[name] / "k3dist.json").read_text())
        cb = class_bytes(builds[name])
        table.append({
            "build": name,
            "class": cls,
            "format": spec[cls] if cls != "all" else spec,
            "formats_used": man["profile"]["nonexpert_modules"],
            "kl": r["kl"],
            "flip": r["flip"],
            "ppl": r["ppl"],
            "kl_by_domain": r["kl_by_domain"],
            "class_bytes": cb.get(cls) if cls != "all" else sum(cb.values()),
            "class_bytes_source": teacher_bytes.get(cls) if cls != "all"
            else sum(teacher_bytes.values()),
            "nonexpert_bytes": sum(cb.values()),
        })
    result = {
        "command": "python benchmarks/nonexpert.py " + " ".join(sys.argv[1:]),
        "evaluate_command": "python -m " + " ".join(cmd),
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
    print(json.dumps(result, indent=1))


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
        "| teacher | - | 0 | 0 | " + " | ".join(f"{t['ppl'][d]:.3f}" for d in doms)
        + " | - |",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['build']} | {r['class']} | {r['kl']:.5f} | {r['flip']:.4f} | "
            + " | ".join(f"{r['ppl'][d]:.3f}" for d in doms)
            + f" | {r['class_bytes']:,} ({r['class_bytes_source']:,}) |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
