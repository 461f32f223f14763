"""One quality table from several ``quality_bits.py`` / ``k3dist.bench.evaluate`` reports
on the same teacher and held-out windows (e.g. a run that adds DWQ rows to an earlier one).

The reports must agree on the teacher (perplexities, bytes, bpw; the build's path may
differ: a rebuilt teacher in another runs folder) and on the windows (split, seq, windows
and tokens per domain). A row present in several reports is kept once (``reports``: the
reports it came from), and its numbers are compared: every field but ``path`` must be
equal, or the row is listed under ``disagreements`` with both values and the later
report's row is kept (``--strict`` refuses instead). Writes the JSON (rows, the reproduced
rows, the disagreements), a markdown table with ``promoted``, ``k_hi`` drop and ``closes
of REF`` (1 - KL / KL(REF)) columns, and the KL-vs-bytes plot.

    python benchmarks/quality/quality_union.py benchmarks/results/2026-12-02/quality-bits-b.json \\
        benchmarks/results/2026-12-03/quality-bits.json --reference 2bit-g64 \\
        --out benchmarks/results/2026-12-03/quality-bits-union.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from k3dist.bench import evaluate

WINDOWS = ("split", "seq", "windows_per_domain", "tokens_per_domain")
TEACHER = ("ppl", "expert_bpw", "bytes", "expert_params")


def _check_same(reports: list[dict], paths: list[str]) -> None:
    first = reports[0]
    for rep, path in zip(reports[1:], paths[1:], strict=True):
        bad = [k for k in WINDOWS if rep[k] != first[k]]
        bad += [f"teacher.{k}" for k in TEACHER if rep["teacher"].get(k) != first["teacher"].get(k)]
        if bad:
            raise SystemExit(
                f"{path} and {paths[0]} disagree on {', '.join(bad)}: "
                "not the same teacher and windows, so their rows are not one table"
            )


def union(reports: list[dict], paths: list[str], strict: bool = False) -> dict:
    """The rows of ``reports`` (same teacher and windows), each build name once."""
    _check_same(reports, paths)
    rows: dict[str, dict] = {}
    source: dict[str, list[str]] = {}
    reproduced: list[str] = []
    disagreements: list[dict] = []
    for rep, path in zip(reports, paths, strict=True):
        for row in rep["rows"]:
            name = row["build"]
            if name in rows:
                old = rows[name]
                diff = {
                    k: [old.get(k), row.get(k)]
                    for k in sorted(set(old) | set(row))
                    if k != "path" and old.get(k) != row.get(k)
                }
                if not diff:
                    reproduced.append(name)
                    source[name].append(path)
                    continue
                if strict:
                    raise SystemExit(
                        f"row {name}: {source[name][-1]} and {path} differ: {json.dumps(diff)}"
                    )
                disagreements.append({"build": name, "reports": [source[name][-1], path], **diff})
            rows[name] = row
            source[name] = [path]
    return {
        **{k: reports[-1][k] for k in ("teacher", *WINDOWS, "batch")},
        "rows": [{**r, "reports": source[n]} for n, r in rows.items()],
        "reports": paths,
        "reproduced": reproduced,
        "disagreements": disagreements,
    }


def closes(rep: dict, reference: str) -> dict[str, float]:
    """1 - KL / KL(reference) for every row."""
    ref = next((r for r in rep["rows"] if r["build"] == reference), None)
    if ref is None:
        raise SystemExit(
            f"--reference {reference}: no such row ({[r['build'] for r in rep['rows']]})"
        )
    return {r["build"]: 1 - r["kl"] / ref["kl"] for r in rep["rows"]}


def markdown(rep: dict, reference: str) -> str:
    doms = list(rep["teacher"]["ppl"])
    t = rep["teacher"]
    close = closes(rep, reference)
    head = (
        "| build | score | expert bpw | expert bytes | mean KL | p95 KL | top-1 flip | "
        + " | ".join(f"{d} ppl" for d in doms)
        + f" | promoted | k_hi drop | closes of {reference} | in reports |"
    )
    lines = [
        f"Teacher (MXFP4 experts, {t['expert_bpw']:.3f} bpw, {t['bytes']:,} expert bytes); "
        f"{rep['split']} split, {rep['windows_per_domain']} windows x {rep['seq']} tokens per "
        "domain; rows from "
        + ", ".join(f"`{p}`" for p in rep["reports"])
        + f". Reproduced exactly in a later report: {', '.join(rep['reproduced']) or 'none'}; "
        f"disagreeing: {', '.join(d['build'] for d in rep['disagreements']) or 'none'}.",
        "",
        head,
        "|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(doms) + "---:|---:|---:|---|",
        evaluate.teacher_cells(t, doms) + " | - | - | - | - |",
    ]
    for r in sorted(rep["rows"], key=lambda r: (r["bytes"], r["kl"])):
        drop = "-" if r["k_hi_drop_rate"] is None else f"{r['k_hi_drop_rate']:.1e}"
        lines.append(
            evaluate.row_cells(r, doms)
            + f" | {r['promoted_share']:.1%} | {drop} | {close[r['build']]:.0%} | "
            + ", ".join(f"`{Path(p).stem}`" for p in r["reports"])
            + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", help="JSON reports, earliest first")
    ap.add_argument("--reference", default="2bit-g64", help="the row 'closes' is measured on")
    ap.add_argument("--strict", action="store_true", help="refuse rows that do not reproduce")
    ap.add_argument("--out", type=Path, required=True, help="JSON; .md and .png beside it")
    a = ap.parse_args()
    reports = [json.loads(Path(p).read_text()) for p in a.reports]
    rep = union(reports, a.reports, a.strict)
    rep["closes"] = {k: round(v, 4) for k, v in closes(rep, a.reference).items()}
    rep["reference"] = a.reference
    for d in rep["disagreements"]:
        print(f"row {d['build']} does not reproduce: {json.dumps(d)}")
    print(f"reproduced: {rep['reproduced']}")
    a.out.write_text(json.dumps(rep, indent=1) + "\n")
    a.out.with_suffix(".md").write_text(markdown(rep, a.reference))
    evaluate.plot(rep, a.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
