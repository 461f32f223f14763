"""Peak memory of a conversion, measured in a child process, against the bound
the streaming design promises: a fixed working set, plus one unit's non-expert
tensors (held up to three times: source, sanitized, serialized) and one tensor in
flight; never the model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from k3dist.format import layout
from k3dist.format.folder import load_config

# The converter's own working set whatever the model size (mlx-lm's lazy model
# skeleton, MLX/numpy allocator pools): 4.6 MB measured converting `mini` (1 MB).
FIXED_OVERHEAD = 16 * 1024 * 1024

_CHILD = """
import json, sys, time
import k3dist.pipeline.convert as c
from k3dist.pipeline.rss import peak_rss, rss
base = rss()  # current RSS: the peak would include transient import peaks
t = time.perf_counter()
c.convert(sys.argv[1], sys.argv[2], int(sys.argv[3]), progress=False)
peak = peak_rss()
print(json.dumps({"baseline_rss": base, "peak_rss": peak,
                  "seconds": round(time.perf_counter() - t, 2)}))
"""


def unit_sizes(config: dict) -> dict:
    """Bytes per conversion unit (decoder layer / head / vision) from the layout."""
    units: dict[str, dict] = {}
    for s in layout.source_specs(config):
        u = units.setdefault(s.group, {"dense": 0, "experts": 0, "largest_tensor": 0})
        u["experts" if s.family == "experts" else "dense"] += s.nbytes
        u["largest_tensor"] = max(u["largest_tensor"], s.nbytes)
    return units


def bound(config: dict) -> dict:
    units = unit_sizes(config)
    dense = max(u["dense"] for u in units.values())
    tensor = max(u["largest_tensor"] for u in units.values())
    layer = max(u["dense"] + u["experts"] for u in units.values())
    return {
        "largest_unit_dense_bytes": dense,
        "largest_tensor_bytes": tensor,
        "largest_unit_bytes": layer,
        "model_bytes": sum(u["dense"] + u["experts"] for u in units.values()),
        "bound_over_baseline": FIXED_OVERHEAD + 3 * dense + 2 * tensor,
    }


def measure(src: str | Path, out: str | Path, nonexpert_bits: int = 16) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src), str(out), str(nonexpert_bits)],
        capture_output=True,
        text=True,
        check=True,
    )
    m = json.loads(r.stdout.strip().splitlines()[-1])
    b = bound(load_config(src))
    over = m["peak_rss"] - m["baseline_rss"]
    return {
        **m,
        **b,
        "peak_over_baseline": over,
        "within_bound": over <= b["bound_over_baseline"],
        "peak_over_baseline_vs_model": round(over / b["model_bytes"], 4),
    }


def child_peak(code: str, *args: str) -> dict:
    """Run ``code`` (``python -c``) with ``args``; its last stdout line is JSON with
    ``baseline_rss`` and ``peak_rss``; adds ``over_baseline``. Exits with the child's
    stderr tail when it fails."""
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    m = json.loads(r.stdout.strip().splitlines()[-1])
    return {**m, "over_baseline": m["peak_rss"] - m["baseline_rss"]}
