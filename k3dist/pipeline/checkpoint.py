"""``python -m k3dist.pipeline.checkpoint audit``: a checkpoint's audit
(``k3dist.pipeline.audit``) printed as a table or JSON. A folder that is an MLX build (ours
or published) gets that build's own audit (``k3dist.pipeline.mlxbuild``).

    python -m k3dist.pipeline.checkpoint audit SRC [--json]
    python -m k3dist.pipeline.checkpoint audit --config kimi-k3-config.json \
        --index kimi-k3-model.safetensors.index.json.gz      # names only, no shards
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from k3dist.format.folder import CONFIG_NAME, INDEX_NAME, SINGLE_FILE
from k3dist.format.sfile import CheckpointError
from k3dist.pipeline import mlxbuild
from k3dist.pipeline.audit import AuditReport, audit, by_family, to_json


def _human(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1000
    return f"{n:,.2f} TB"


def _listing(title: str, items: list[str], limit: int = 10) -> list[str]:
    if not items:
        return []
    out = [f"{title} ({len(items):,}):"] + [f"  {x}" for x in items[:limit]]
    if len(items) > limit:
        out.append(f"  ... and {len(items) - limit:,} more (--json lists all)")
    return out


def format_table(r: AuditReport, top: int = 5) -> str:
    """A human summary: families, shards (the ``top`` largest when there are many),
    coverage, findings and which checks ran or were skipped."""
    lines = [
        f"k3dist audit of {r.source}",
        f"  config {r.config_path}",
        f"  index  {r.index_path}  sha256 {r.index_sha256[:16]}",
        "",
        f"{'family':<16}{'tensors':>10}{'implied':>10}{'bytes (implied)':>22}",
    ]
    fams = list(by_family(Counter({**r.expected_counts, **r.counts})))
    for fam in fams:
        lines.append(
            f"{fam:<16}{r.counts.get(fam, 0):>10,}{r.expected_counts.get(fam, 0):>10,}"
            f"{r.family_bytes.get(fam, 0):>22,}"
        )
    if r.unexpected:
        lines.append(f"{'(not implied)':<16}{len(r.unexpected):>10,}{0:>10,}{'?':>22}")
    lines.append(
        f"{'total':<16}{r.tensors:>10,}{r.expected_tensors:>10,}{sum(r.family_bytes.values()):>22,}"
    )
    lines.append(f"routed expert packed weights: {r.expert_packed:,}")
    lines.append("")

    src = (
        "tensor bytes from the shard headers"
        if r.bytes_from == "headers"
        else "bytes config.json implies for the tensors the index places there"
    )
    lines.append(f"shards: {len(r.shard_tensors)} ({src})")
    names = list(r.shard_tensors)
    if len(names) > 2 * top:
        shown = sorted(r.shard_bytes, key=r.shard_bytes.__getitem__, reverse=True)[:top]
        shown = sorted(set(shown) | set(r.shard_errors))
    else:
        shown = names
    width = max([len(n) for n in names] + [5])
    for n in shown:
        size = f"{r.shard_bytes[n]:>22,}" if n in r.shard_bytes else f"{'UNREADABLE':>22}"
        lines.append(f"  {n:<{width}}{r.shard_tensors[n]:>9,} tensors{size}")
    if len(shown) < len(names):
        lines.append(f"  ... {len(names) - len(shown)} more shards (the {top} largest shown)")
    size_note = ""
    if r.index_total_size is not None:
        same = "=" if r.index_total_size == r.total_bytes else "!="
        size_note = f"  {same} index total_size {r.index_total_size:,}"
    lines.append(
        f"  {'total':<{width}}{r.tensors:>9,} tensors{r.total_bytes:>22,}"
        f"  ({_human(r.total_bytes)}){size_note}"
    )
    lines.append("")

    if not r.missing and not r.unexpected:
        lines.append(
            "coverage: complete (every key config.json implies is in the index, and nothing else)"
        )
    else:
        lines.append(f"coverage: {len(r.missing):,} missing, {len(r.unexpected):,} unexpected")
    lines += _listing("missing keys", r.missing)
    lines += _listing("unexpected keys", r.unexpected)
    lines += _listing("unreadable shards", [f"{f}: {m}" for f, m in r.shard_errors.items()])
    lines += _listing("index vs shard headers", r.index_errors)
    lines += _listing("dtype/shape mismatches", r.mismatches)
    if r.a_log:
        bad = r.a_log_failures
        lines.append(
            f"A_log padding: {len(r.a_log)} KDA layers checked, "
            + (f"{len(bad)} with a non-zero tail" if bad else "every tail is zero")
        )
        lines += _listing("A_log failures", [f"layer {k}: {v}" for k, v in bad.items()])
    lines += _listing("other", r.errors)
    lines.append("")
    lines.append("checks run: " + ", ".join(r.checks_run))
    for check, why in r.checks_skipped.items():
        lines.append(f"skipped: {check} ({why})")
    verdict = "OK" if r.ok else f"FAILED: {r.findings:,} findings"
    lines.append(f"result: {verdict}  [{r.seconds:.2f} s]")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m k3dist.pipeline.checkpoint",
        description="Moonshot-format K3 checkpoints, read through their headers.",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    a = sub.add_parser(
        "audit",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="tensor counts, bytes, key coverage, dtypes/shapes, A_log padding",
        description=(
            "Audit a checkpoint from its index and shard headers (no tensor data is read\n"
            "except each KDA layer's A_log padding tail): tensor counts and bytes by family,\n"
            "bytes per shard, coverage against the keys config.json implies, dtypes and\n"
            "shapes, A_log tails. With only a config and an index (no shard files), names,\n"
            "counts, coverage and total_size are checked and the header checks are listed\n"
            "as skipped."
        ),
        epilog=(
            "examples:\n"
            "  python -m k3dist.pipeline.checkpoint audit mini-src\n"
            "  python -m k3dist.pipeline.checkpoint audit --json \\\n"
            "      --config k3dist/data/kimi-k3-config.json \\\n"
            "      --index k3dist/data/kimi-k3-model.safetensors.index.json.gz\n\n"
            "exit status: 0 ok, 1 findings (all are printed), 2 nothing to audit"
        ),
    )
    a.add_argument(
        "src",
        nargs="?",
        help=f"checkpoint folder (config.json, {INDEX_NAME} or {SINGLE_FILE}, shard files)",
    )
    a.add_argument(
        "--config", help="config JSON file, may be gzipped (.gz); default SRC/config.json"
    )
    a.add_argument(
        "--index",
        help=f"index JSON file, may be gzipped (.gz); default "
        f"SRC/{INDEX_NAME}. Shards are looked for in SRC, else beside the index",
    )
    a.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    if args.src is None and (args.config is None or args.index is None):
        a.error("give a checkpoint folder SRC, or both --config and --index")
    if args.src and args.config is None and args.index is None:
        if (Path(args.src) / CONFIG_NAME).exists() and mlxbuild.is_mlx_build(args.src):
            # an MLX build (ours or published): its own audit (k3dist.pipeline.mlxbuild)
            return mlxbuild.main([args.src, *(["--json"] if args.json else [])])
    try:
        report = audit(args.src, config=args.config, index=args.index)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(to_json(report) if args.json else format_table(report))
    if not report.ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
