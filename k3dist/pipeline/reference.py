"""The whole graded build a pipeline's rank folders were sliced from, written in one
folder: what single-process mlx-lm runs for parity with the ranks (the pipeline itself
never writes it, ``k3dist.pipeline.direct``).

    python -m k3dist.pipeline.reference --src SRC --pipeline OUT --out BUILD

From the pipeline's ``plan.json`` and its calibration (``OUT/work/calib``: the scores and
routes the graded stage promoted by), through the same ``profiles.convert_profile``; the
written build's hash must be the rank folders' (a pipeline run with ``--dwq`` rewrote
them: refused).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from k3dist.format.manifest import MANIFEST
from k3dist.format.sfile import CheckpointError
from k3dist.pipeline import profiles
from k3dist.pipeline.runner import base_view
from k3dist.pipeline.stage_graph import RANK_PATTERN, Args


def write_reference(src: str | Path, pipeline: str | Path, out: str | Path) -> Path:
    """Write the graded build of ``pipeline``'s rank folders to ``out`` (module doc)."""
    a = Args(src=str(src), out=str(pipeline))
    plan = json.loads(a.path("plan").read_text())
    cal = a.path("calibrate")
    rank0 = Path(pipeline) / RANK_PATTERN.format(rank=0)
    for need in (cal / "scores-taylor.npz", cal / "routes.npz", rank0 / MANIFEST):
        if not need.exists():
            raise CheckpointError(f"{need}: missing; run the pipeline to its graded stage first")
    built = profiles.convert_profile(
        src,
        out,
        "graded",
        base=base_view(a, plan),
        scores=cal / "scores-taylor.npz",
        routes=cal / "routes.npz",
        plan=plan,
        progress=False,
    )
    have = json.loads((built / MANIFEST).read_text())["build_hash"]
    ranks = json.loads((rank0 / MANIFEST).read_text())["build_hash"]
    if have != ranks:
        raise CheckpointError(
            f"{out}: build {have}, but {rank0} holds build {ranks} (a --dwq run rewrites the "
            "rank folders); run the pipeline without --dwq for a reference"
        )
    return built


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True, help="the source the pipeline ran on")
    ap.add_argument("--pipeline", required=True, help="the pipeline's --out")
    ap.add_argument("--out", required=True, help="where the whole graded build goes")
    args = ap.parse_args(argv)
    try:
        print(f"wrote {write_reference(args.src, args.pipeline, args.out)}")
    except (CheckpointError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
