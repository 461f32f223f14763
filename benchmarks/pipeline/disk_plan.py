"""The real K3's build plan and disk plan, without weights (``k3dist/data``'s config and
tensor index), as the two-Mac guide's pipeline command makes them: the planner's default
budget, 16 windows x 256 calibration tokens, with and without ``--dwq``.

    python benchmarks/pipeline/disk_plan.py --out benchmarks/results/DATE/disk-plan-k3.json

``tests/test_docs.py`` plans again and fails when the committed file has drifted from
what the code plans now (then run this again and update the figures it names).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys

from k3dist.pipeline import diskplan, runner

ARGV = ["--real-k3", "--dry-run"]  # the guide's command without --src/--out: no weights


def plans() -> dict:
    """{"plan": the byte-budget plan, "disk_plan": ..., "disk_plan_dwq": ...}."""
    a, _ = runner.parse(ARGV)
    config, index, source_bytes = diskplan.read_config_index(a)
    acc = diskplan.account(a, config, index)
    plan = diskplan.make_plan(a, acc)  # --dwq does not change the plan
    a_dwq, _ = runner.parse([*ARGV, "--dwq"])
    return {
        "plan": {k: v for k, v in plan.items() if k != "assumptions"},
        "disk_plan": diskplan.disk_plan(a, acc, plan, source_bytes),
        "disk_plan_dwq": diskplan.disk_plan(a_dwq, acc, plan, source_bytes),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the JSON here too")
    ns = ap.parse_args(argv)
    with contextlib.redirect_stdout(io.StringIO()):
        report = plans()
    report = {
        "command": "python benchmarks/pipeline/disk_plan.py"
        + (f" --out {ns.out}" if ns.out else ""),
        "pipeline_command": "python -m k3dist.pipeline.runner " + " ".join(ARGV) + " [--dwq]",
        **report,
    }
    text = json.dumps(report, indent=1)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text + "\n")
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
