"""Audit an MLX build of K3 that k3dist may not have made (e.g. a published mlx-lm
build: ``mlx_lm.utils.save_model`` files, uniform affine experts, no ``k3dist.json``),
before slicing it (``slicing/rank_split.py --build``) and serving its rank folders.

Checked, from headers only (no tensor data is read):

- ``config.json`` is a K3 config (``model_type`` ``kimi_k3``) with a quantization block
  mlx-lm reads, or none;
- the index names files that exist, and every tensor it names is in its file's header;
- mlx-lm's own ``kimi_k3`` model, built from the config (``load_model(lazy=True,
  strict=True)``), takes exactly these tensor names and shapes: the check the loader
  applies when a rank loads;
- the routed experts are stacked per layer (``switch_mlp``, leading dim = the config's
  ``num_experts``) and split evenly over ``--ranks``, as the slicer needs.

Not verifiable without a manifest (said in the report): which source the weights came
from and whether their bytes are the ones the publisher wrote (no ``k3dist.json`` sha256
per file); the quality of its quantization (measure it: ``k3dist.bench.evaluate``).
Slicing records the sha256 of every rank file, so the rank folders are verified from
then on like ours (``k3dist.format.verify``).

    python -m k3dist.pipeline.mlxbuild BUILD [--ranks 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from k3dist.format import layout
from k3dist.format.folder import CONFIG_NAME, load_config, weight_map
from k3dist.format.manifest import MANIFEST
from k3dist.format.sfile import CheckpointError, read_header

_STACK = re.compile(r"layers\.(\d+)\.mlp\.switch_mlp\.(\w+)\.weight$")

CANNOT_VERIFY = [
    "the source these weights were made from (no k3dist.json: no source index/config hash)",
    "that the bytes are the publisher's (no per-file sha256 to compare against; slicing "
    "records one per rank file, verified from then on)",
    "the quality of the quantization (measure it: python -m k3dist.bench.evaluate)",
]


def is_mlx_build(path: str | Path) -> bool:
    """An mlx-lm-format folder (stacked ``switch_mlp`` experts), not Moonshot's."""
    try:
        return any(".switch_mlp." in n for n in weight_map(path))
    except CheckpointError:
        return False


def audit_build(path: str | Path, ranks: int = 2) -> dict:
    t0 = time.perf_counter()
    path = Path(path)
    findings: list[str] = []
    checks: list[str] = []
    cfg_path = path / CONFIG_NAME
    config = load_config(path)
    checks.append("config")
    if config.get("model_type") != "kimi_k3":
        findings.append(f"{cfg_path}: model_type {config.get('model_type')!r}, not 'kimi_k3'")
    tc = layout.text_config(config)
    files = weight_map(path)
    shapes: dict[str, list[int]] = {}
    for f in sorted(set(files.values())):
        p = path / f
        if not p.exists():
            findings.append(f"{p}: named by the index, missing")
            continue
        h = read_header(p)
        for n, t in h.tensors.items():
            shapes[n] = list(t.shape)
        for n in (n for n, g in files.items() if g == f):
            if n not in h.tensors:
                findings.append(f"{p}: tensor {n!r} named by the index is not in the file")
    checks.append("index_vs_headers")
    E = tc.get("num_experts") or 0
    stacks = 0
    for n, shape in shapes.items():
        m = _STACK.search(n)
        if m:
            stacks += 1
            if not shape or shape[0] != E:
                findings.append(
                    f"{n}: leading dim {shape[:1]} is not the config's "
                    f"num_experts {E}; the slicer needs experts stacked per layer"
                )
    if E and stacks == 0:
        findings.append(
            f"{path}: no stacked expert tensors (switch_mlp); not an mlx-lm kimi_k3 build"
        )
    if E and E % ranks:
        findings.append(f"{E} experts do not split evenly over {ranks} ranks")
    checks.append("expert_stacks")
    if not findings:
        findings += _model_check(path, config)
        checks.append("mlx_lm_model_names_and_shapes")
    has_manifest = (path / MANIFEST).exists()
    if has_manifest:
        from k3dist.format import manifest

        try:
            manifest.verify(path, "build", sha256=False)
            checks.append("k3dist_manifest")
        except CheckpointError as e:
            findings.append(str(e))
    quant = config.get("quantization") or {}
    return {
        "path": str(path),
        "ok": not findings,
        "findings": findings,
        "checks": checks,
        "tensors": len(shapes),
        "expert_stacks": stacks,
        "num_experts": E,
        "quantization": {k: v for k, v in quant.items() if not isinstance(v, dict)},
        "quantized_paths_with_own_format": sum(isinstance(v, dict) for v in quant.values()),
        "k3dist_manifest": has_manifest,
        "cannot_verify": [] if has_manifest else CANNOT_VERIFY,
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _model_check(path: Path, config: dict) -> list[str]:
    """mlx-lm's kimi_k3 built from the config takes exactly the files' names and shapes
    (strict load, lazy: no tensor data read)."""
    from mlx_lm.utils import load_model

    if "graded" in config:
        from k3dist.model import two_bank

        def loader():
            return two_bank.load_build(path, lazy=True)
    else:

        def loader():
            return load_model(path, lazy=True, strict=True)

    try:
        loader()
    except (ValueError, KeyError) as e:
        return [f"{path}: mlx-lm's kimi_k3 refuses these weights: {e}"]
    return []


def format_report(r: dict) -> str:
    lines = [
        f"{r['path']}: {r['tensors']:,} tensors, {r['expert_stacks']} expert stacks "
        f"({r['num_experts']} experts), quantization {r['quantization']}"
        + (
            f" + {r['quantized_paths_with_own_format']} paths with their own format"
            if r["quantized_paths_with_own_format"]
            else ""
        ),
        f"checks run: {', '.join(r['checks'])}",
    ]
    lines += [f"  {f}" for f in r["findings"]]
    if r["cannot_verify"]:
        lines.append("cannot be verified without a k3dist manifest:")
        lines += [f"  - {x}" for x in r["cannot_verify"]]
    verdict = "OK" if r["ok"] else f"FAILED: {len(r['findings'])} findings"
    lines.append(f"result: {verdict}  [{r['seconds']:.2f} s]")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Audit an MLX K3 build (ours or published).")
    ap.add_argument("build")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        r = audit_build(a.build, a.ranks)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(r, indent=1) if a.json else format_report(r))
    sys.exit(0 if r["ok"] else 1)


if __name__ == "__main__":
    main()
