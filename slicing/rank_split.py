"""One folder per rank for expert parallelism: every dense/attention tensor plus the
routed experts the rank owns, and a manifest naming rank, size, placement and build.

    python slicing/rank_split.py --rank 1              # deploy/local.yaml, mini build
    python slicing/rank_split.py --all --size 2 --build BUILD --out 'runs/ranks/rank{rank}'
    python slicing/rank_split.py --all --boxes 512,256,256 --out 'runs/ranks3/rank{rank}'

Any --size works (16 experts over 3 ranks: 6:5:5, rotated over the layers); --boxes
places each layer's experts by each box's memory (GiB it gives the weights, one per
rank, in rank order; --size follows it).

--build takes an MLX build (k3dist.pipeline.convert, or an mlx-community K3 build) or a
Moonshot-format checkpoint. Flags override the deployment YAML (--config, by default
deploy/local.yaml when it exists); k3dist.config.deployment.Deployment holds the defaults.
With the default build missing, it is made first (k3dist.pipeline.default).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from k3dist.config import deployment
from k3dist.format import manifest
from k3dist.format.placement import PlacementError
from k3dist.format.sfile import CheckpointError
from k3dist.pipeline import default, slicing

# what slicing takes of the deployment (rank_dir's flag is --out)
KEYS = (*deployment.keys("build"), "rank_dir", "attention")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--rank", type=int, help="the rank whose folder to write")
    which.add_argument("--all", action="store_true", help="write every rank's folder")
    deployment.add_arguments(ap, KEYS, names={"rank_dir": "--out"})
    args = ap.parse_args()
    d = deployment.from_args(ap, args, KEYS)
    try:
        if not args.all:
            slicing.check_rank(args.rank, d.size)  # before any (default) build work
        build = Path(d.build)
        if build == default.DEFAULT_BUILD and not (build / "k3dist.json").exists():
            print(f"{build}: missing; making the default mini build")
            default.ensure_default_build(progress=True)
        placement = slicing.placement_for(build, d.size, d.placement_counts, d.box_gib, d.attention)
        print(f"build {build}, {d.size} ranks, placement {placement.describe()} ({placement.hash})")
        if args.all:
            paths = slicing.slice_all(build, d.rank_dir, d.size, placement, attention=d.attention)
        else:
            paths = [
                slicing.slice_rank(
                    build,
                    d.rank_path(args.rank),
                    args.rank,
                    d.size,
                    placement,
                    attention=d.attention,
                )
            ]
        for p in paths:
            m = manifest.verify(p, "rank")
            a = manifest.attention_of(m)
            print(
                f"rank {m['rank']}: {p} ({m['expert_bytes']:,} expert bytes, attention "
                f"{a['mode']} over layers {a['split_layers']})"
            )
    except (CheckpointError, PlacementError, ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
