"""What teacher, calibration and the graded stage cost at K3's counts apart from what
scales with bytes and tokens: the k3counts preset (93 layers, 896 experts, 497,220
tensors) through the pipeline's own views, teacher and calibration on one window of a
few tokens, so that what is left scales with tensors, experts and layers (and, for
calibration, with expert parameters: its dense expert gradients and the student's
re-quantization); the graded stage as the pipeline runs it, into two rank folders.

    python benchmarks/pipeline/count_overhead.py --pipeline OUT --tokens 4 --work DIR --out FILE

``--pipeline``: a finished pipeline run on the preset (its ``plan.json``, token set and
source); CPU seconds of this process per part, and its peak RSS. Each part's CPU is
also split at ``mx.eval``: inside it MLX computes (over the preset's bytes, parameters
and tokens: on the real K3 that is disk, GPU and bandwidth, projected apart); outside
it Python builds, reads and checks, which is what scales with tensor, expert and layer
counts. Evaluation that ``.item()`` or ``np.array`` force is counted outside (an upper
bound on the overhead); the graded stage's re-quantization (``promote.requantize``) is
evaluated inside ``mx.eval`` here, so it counts as compute. The graded stage's SHA-256
(every rank-folder byte through two digests, ``sfile.StreamWriter``) is measured apart:
the same bytes hashed twice by hashlib in this process (``sha256_cpu_s``), a term the
projection counts at its own rate. User and system CPU are reported apart: system time
is mostly the kernel's reads and writes, bytes that the projection counts as disk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import sys
import time
from pathlib import Path

from k3dist.pipeline import calibrate, profiles, promote, runner, student, teacher

import mlx.core as mx


class EvaluatedRequantize:
    """``promote.requantize`` with its outputs evaluated by ``mx.eval`` (so inside
    :class:`EvalClock`); the bytes written are the same."""

    def __enter__(self):
        self._orig = promote.requantize

        def evaluated(*args, **kw):
            out = self._orig(*args, **kw)
            mx.eval(*out)
            return out

        promote.requantize = evaluated
        return self

    def __exit__(self, *exc):
        promote.requantize = self._orig


def hash_cpu_s(folders: list[Path], copies: int = 2) -> tuple[float, int]:
    """CPU seconds to SHA-256 every ``*.safetensors`` byte of ``folders`` ``copies``
    times (the file digest and the tensor digests), and the bytes read once."""
    t, n = time.process_time(), 0
    for folder in folders:
        for f in sorted(folder.glob("*.safetensors")):
            data = f.read_bytes()
            n += len(data)
            for _ in range(copies):
                h = hashlib.sha256()
                for i in range(0, len(data), 1 << 20):
                    h.update(data[i : i + (1 << 20)])
    return time.process_time() - t, n


class EvalClock:
    """CPU seconds spent inside ``mx.eval``, summed (``mx.eval`` is wrapped while on)."""

    def __init__(self):
        self.inside = 0.0
        self._eval = mx.eval

    def __enter__(self):
        def timed(*args, **kw):
            t = time.process_time()
            try:
                return self._eval(*args, **kw)
            finally:
                self.inside += time.process_time() - t

        mx.eval = timed
        return self

    def __exit__(self, *exc):
        mx.eval = self._eval


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipeline", required=True, help="a pipeline OUT on the preset")
    ap.add_argument("--tokens", type=int, default=4, help="tokens of the one window")
    ap.add_argument("--work", required=True, help="scratch folder (emptied)")
    ap.add_argument("--out", help="JSON file to write")
    args = ap.parse_args()
    run = Path(args.pipeline)
    summary = json.loads((run / "summary.json").read_text())
    plan = json.loads((run / "plan.json").read_text())
    src = summary["command"][summary["command"].index("--src") + 1]
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    a, _ = runner.parse(["--src", src, "--out", str(work), "--target-bpw", "2.6"])
    tokens = teacher.read_tokens(run / "work" / "tokens.npz")[:1, : args.tokens]
    load0 = os.getloadavg()[0]
    cpu, in_eval, sys_s = {}, {}, {}

    def part(name, fn):
        t, s0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_stime
        with EvalClock() as clock:
            out = fn()
        cpu[name], in_eval[name] = time.process_time() - t, clock.inside
        sys_s[name] = resource.getrusage(resource.RUSAGE_SELF).ru_stime - s0
        return out

    base = part("view_build", lambda: runner.base_view(a, plan))
    part("teacher_after_view", lambda: teacher.run(base, tokens, work / "teacher", progress=False))
    part(
        "calibrate",
        lambda: calibrate.calibrate(
            student.LoView(base, plan["lo"]["format"]),
            base,
            work / "teacher",
            tokens,
            work / "cal",
            progress=False,
        ),
    )
    cal = runner.parse(["--src", src, "--out", str(run), "--target-bpw", "2.6"])[0].path(
        "calibrate"
    )
    ranks = str(work / "rank{rank}")
    with EvaluatedRequantize():
        part(
            "graded",
            lambda: profiles.convert_profile(
                src,
                work / "graded",
                "graded",
                base=base,
                scores=cal / "scores-taylor.npz",
                routes=cal / "routes.npz",
                plan=plan,
                rank_pattern=ranks,
                progress=False,
            ),
        )
    folders = [Path(ranks.format(rank=r)) for r in range(plan["ranks"])]
    sha_cpu, sha_bytes = hash_cpu_s(folders)
    outside = {k: cpu[k] - in_eval[k] for k in cpu}
    report = {
        "command": "python benchmarks/pipeline/count_overhead.py " + " ".join(sys.argv[1:]),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg_1m": {"start": load0, "end": os.getloadavg()[0]},
        "source": src,
        "tokens": list(tokens.shape),
        "cpu_s": {k: round(v, 1) for k, v in cpu.items()},
        "cpu_s_in_eval": {k: round(v, 1) for k, v in in_eval.items()},
        "cpu_s_outside_eval": {k: round(v, 1) for k, v in outside.items()},
        "sys_cpu_s": {k: round(v, 1) for k, v in sys_s.items()},
        "graded": {
            "rank_folder_bytes": sha_bytes,
            "sha256_cpu_s": round(sha_cpu, 1),
            # outside eval, less the digests: what builds, reads, slices and writes
            "outside_eval_less_sha256_s": round(outside["graded"] - sha_cpu, 1),
        },
        "teacher_cpu_s": round(cpu["view_build"] + cpu["teacher_after_view"], 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }
    shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
