"""What every benchmark records beside its numbers: trial statistics, the exact
command, versions, machine and backend, the ``mlx.launch`` parent's CPU use, memory,
and the JSON report itself (gathered from every rank, written ``.partial`` then
renamed)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import k3dist
from k3dist.model.group import join
from k3dist.pipeline.rss import peak_rss

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
from mlx.utils import tree_flatten

REPO = k3dist.REPO


def stats(xs: Sequence[float], digits: int = 4) -> dict:
    """Median and spread (p10, p90) of a list of trials."""
    a = np.asarray(xs, dtype=np.float64)
    if a.size == 0:
        return {"n": 0}
    return {
        "median": round(float(np.median(a)), digits),
        "p10": round(float(np.percentile(a, 10)), digits),
        "p90": round(float(np.percentile(a, 90)), digits),
        "mean": round(float(a.mean()), digits),
        "n": int(a.size),
    }


def emit(report: dict, out: str | Path | None, indent: int = 2) -> str:
    """Print a benchmark's JSON report and write it to ``out`` when given."""
    text = json.dumps(report, indent=indent)
    print(text)
    if out:  # .partial then renamed: a killed run leaves no half report
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_suffix(out.suffix + ".partial")
        part.write_text(text + "\n")
        part.rename(out)
    return text


def repo_path(path: str | Path) -> str:
    """``path`` as results record it: relative to the repository, never a machine path
    (a folder outside the repository, e.g. a temporary one, as ``<temp>/NAME``)."""
    p = Path(path)
    if not p.is_absolute():
        return str(p)
    try:
        return str(p.resolve().relative_to(REPO))
    except ValueError:
        return f"<temp>/{p.name}"


def command_line(argv: Sequence[str] | None = None) -> str:
    """This process's command as results record it: ``python`` and repository-relative
    paths (an absolute argument outside the repository is kept: it was asked for)."""
    argv = sys.argv if argv is None else argv

    def rel(a: str) -> str:
        p = Path(a)
        if p.is_absolute() and p.resolve().is_relative_to(REPO):
            return str(p.resolve().relative_to(REPO))
        return a

    return " ".join(shlex.quote(rel(a)) for a in ["python", *argv])


def versions() -> dict:
    """k3dist's, MLX's, mlx-lm's and Python's versions."""
    return {
        "k3dist": k3dist.__version__,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "python": platform.python_version(),
    }


def environment(argv: Sequence[str] | None = None) -> dict:
    """The exact command, versions, machine, backend and BLAS of this process."""
    return {
        "command": command_line(argv),
        "versions": versions(),
        "machine": platform.platform(),
        "processor": _cpu_model() or platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "backend": {"device": str(mx.default_device()), "metal": mx.metal.is_available()},
        "blas": k3dist.blas_status(),
        "distributed": _launch_info(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        return None


def _launch_info() -> dict:
    """What mlx.launch passed this rank: its rank and the ring's addresses."""
    info: dict = {"rank": os.environ.get("MLX_RANK")}
    hf = os.environ.get("MLX_HOSTFILE")
    if hf:
        try:
            info["ring"] = json.loads(Path(hf).read_text())
        except (OSError, ValueError):
            info["ring"] = None
    return info


def launcher() -> dict | None:
    """The ``mlx.launch`` process that started this rank (its parent, when the rank
    runs on the launching machine): pid and CPU seconds so far. ``None`` otherwise."""
    ppid = os.getppid()
    try:
        cmd = Path(f"/proc/{ppid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        if "mlx.launch" not in cmd:
            return None
        f = Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return {
        "pid": ppid,
        "cpu_s": (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK"),
        "nice": os.getpriority(os.PRIO_PROCESS, ppid),
    }


def nice_launcher(niceness: int = 19) -> dict | None:
    """Lower the scheduling priority of this rank's ``mlx.launch`` parent. Its output
    threads poll in a loop (``select`` on each child's always-writable stdin pipe
    returns at once): measured here ~1.4 cores of a 2-core box for the whole run,
    taken from the ranks. Returns the launcher's info after, None if not found."""
    info = launcher()
    if info is not None and info["nice"] < niceness:
        os.setpriority(os.PRIO_PROCESS, info["pid"], niceness)
        info = launcher()
    return info


def add_rank_args(ap: argparse.ArgumentParser) -> None:
    """The flags of a benchmark that runs on every rank of an mlx.launch group (read by
    :func:`start_rank`)."""
    ap.add_argument(
        "--blas-threads",
        type=int,
        default=1,
        help="OpenBLAS threads per rank (default 1: ranks share the box)",
    )
    ap.add_argument(
        "--nice-launcher",
        action="store_true",
        help="lower mlx.launch's priority (its output loop spins ~1.4 cores here)",
    )


def start_rank(args: argparse.Namespace) -> tuple[mx.distributed.Group, dict | None]:
    """This rank's OpenBLAS threads set, its group joined, and its launcher's info
    (reniced first with ``--nice-launcher``): :func:`add_rank_args`' flags."""
    k3dist.set_blas_threads(args.blas_threads)
    group = join()
    return group, nice_launcher() if args.nice_launcher else launcher()


def memory() -> dict:
    return {
        "mx_peak_bytes": int(mx.get_peak_memory()),
        "mx_active_bytes": int(mx.get_active_memory()),
        "vm_hwm_bytes": peak_rss(),
    }


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds for ``model``."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def gather_json(obj, group: mx.distributed.Group | None) -> list:
    """Every rank's ``obj`` (JSON-able), in rank order, on every rank."""
    if group is None or group.size() == 1:
        return [obj]
    data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8).astype(np.int32)
    n = int(mx.distributed.all_gather(mx.array([data.size]), group=group).max().item())
    pad = np.zeros(n + 1, dtype=np.int32)
    pad[0], pad[1 : data.size + 1] = data.size, data
    rows = np.array(mx.distributed.all_gather(mx.array(pad)[None], group=group))
    return [json.loads(bytes(r[1 : r[0] + 1].astype(np.uint8)).decode()) for r in rows]
