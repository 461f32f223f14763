"""Peak RSS of converting a checkpoint vs the bound from its largest unit.

    python benchmarks/memory/convert_memory.py --preset bench [--out results.json]

Prints JSON with the command, versions and, for the real K3 config, the same
bound computed from the layout (what a 1.56 TB conversion will hold at most).
"""

from __future__ import annotations

import argparse
import platform
import tempfile
from pathlib import Path

from k3dist.bench import membound, record
from k3dist.factory import synth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench", choices=sorted(synth.PRESETS))
    ap.add_argument("--src", help="existing Moonshot-format folder (instead of --preset)")
    ap.add_argument("--nonexpert-bits", type=int, default=16, choices=(16, 8, 4))
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        src = (
            Path(args.src)
            if args.src
            else synth.synthesize(Path(tmp) / "src", args.preset, progress=False)
        )
        result = membound.measure(src, Path(tmp) / "build", args.nonexpert_bits)
    report = {
        "command": record.command_line(),
        "versions": record.versions(),
        "machine": platform.platform(),
        "source": args.src or f"synth preset {args.preset}",
        "result": result,
        "real_k3_bound": membound.bound(synth.real_config()),
    }
    record.emit(report, args.out)


if __name__ == "__main__":
    main()
