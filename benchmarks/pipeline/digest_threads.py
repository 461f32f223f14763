"""StreamWriter's two SHA-256 digests on one thread (before) against two threads of
their own (now), side by side in one process on the same bytes.

    python benchmarks/pipeline/digest_threads.py --old OLD_SFILE.py --mb 512 --reps 3 --out FILE

``--old``: the previous ``k3dist/format/sfile.py`` (``git show REV:k3dist/format/sfile.py``);
each rep writes the same ``--mb`` of random bytes as 64 MiB chunks of one tensor per
chunk, with each writer in turn, into ``--dir``; wall and CPU seconds per writer, the
digests compared.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

from k3dist.format import sfile

import numpy as np


def _load(path: str):
    spec = importlib.util.spec_from_file_location("sfile_old", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sfile_old"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _write(mod, path: Path, chunks: list[bytes]) -> tuple[float, float, str, dict]:
    entries = [(f"t{i}", "U8", (len(c),)) for i, c in enumerate(chunks)]
    t, c = time.perf_counter(), time.process_time()
    with mod.StreamWriter(path, entries) as w:
        for (name, _, _), b in zip(entries, chunks, strict=True):
            w.write(name, b)
    out = time.perf_counter() - t, time.process_time() - c, w.sha256, w.tensor_sha256
    path.unlink()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    old = _load(a.old)
    rng = np.random.default_rng(0)
    chunk = sfile.CHUNK_BYTES
    chunks = [
        rng.integers(0, 256, chunk, dtype=np.uint8).tobytes() for _ in range(a.mb * 2**20 // chunk)
    ]
    d = Path(a.dir)
    rows = {"one_thread": [], "two_threads": []}
    load = [os.getloadavg()[0]]
    for _ in range(a.reps):
        for key, mod in (("one_thread", old), ("two_threads", sfile)):
            wall, cpu, digest, tensors = _write(mod, d / f"digest-{key}.safetensors", chunks)
            rows[key].append(
                {
                    "wall_s": round(wall, 3),
                    "cpu_s": round(cpu, 3),
                    "sha256": digest,
                    "tensors": tensors,
                }
            )
    load.append(os.getloadavg()[0])
    same = all(
        a_["sha256"] == b_["sha256"] and a_["tensors"] == b_["tensors"]
        for a_, b_ in zip(rows["one_thread"], rows["two_threads"], strict=True)
    )
    best = {k: min(r["wall_s"] for r in v) for k, v in rows.items()}
    report = {
        "command": "python benchmarks/pipeline/digest_threads.py "
        + " ".join(f"--{k} {v}" for k, v in vars(a).items()),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg_1m": {"start": load[0], "end": load[1]},
        "bytes": len(chunks) * chunk,
        "digests_equal": same,
        "best_wall_s": best,
        "speedup_best_wall": round(best["one_thread"] / best["two_threads"], 2),
        "gb_per_s_best": {k: round(len(chunks) * chunk / v / 1e9, 3) for k, v in best.items()},
        "runs": {k: [{x: r[x] for x in ("wall_s", "cpu_s")} for r in v] for k, v in rows.items()},
    }
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    print(
        json.dumps(
            {
                k: report[k]
                for k in (
                    "loadavg_1m",
                    "digests_equal",
                    "best_wall_s",
                    "speedup_best_wall",
                    "gb_per_s_best",
                )
            }
        )
    )


if __name__ == "__main__":
    main()
