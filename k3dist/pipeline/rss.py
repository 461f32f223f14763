"""A process's resident memory: now and at its peak (Linux ``/proc``; ``ru_maxrss``
where there is no ``/proc``). What the build's stages record in their manifests and
the memory benchmarks measure against their bounds."""

from __future__ import annotations

import resource
import sys


def _status(pid: int | str, key: str) -> int | None:
    """A ``/proc/PID/status`` field in bytes (``VmHWM``, ``VmRSS``), None without one."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(x.split()[1]) * 1024 for x in f if x.startswith(key + ":")), None)
    except OSError:
        return None


def _maxrss() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024  # bytes on macOS, KiB on Linux


def rss(pid: int | None = None) -> int | None:
    """Resident memory now, in bytes, of this process (``pid`` None) or ``pid`` (None
    when it has no ``/proc`` entry). Without ``/proc``, this process's peak instead (an
    upper bound)."""
    now = _status("self" if pid is None else pid, "VmRSS")
    return _maxrss() if now is None and pid is None else now


def peak_rss(pid: int | None = None) -> int | None:
    """Peak resident memory in bytes of this process or ``pid`` (Linux ``VmHWM``: it
    belongs to this exec's address space, where ``ru_maxrss`` survives exec and would
    report the parent's RSS at fork time; None for a ``pid`` without ``/proc`` entry).
    Without ``/proc``, this process's ``ru_maxrss``."""
    peak = _status("self" if pid is None else pid, "VmHWM")
    return _maxrss() if peak is None and pid is None else peak
