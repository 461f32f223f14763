"""The hosts of a run: read as mlx.launch reads them, probed over ssh before anything starts.

``read_hosts`` uses mlx.launch's own hostfile parser; ``preflight_hosts`` probes every
remote host at once (ssh without a password, the same python there) and raises
``HostUnreachable`` naming each host that failed and its fix, before any rank starts.
"""

from __future__ import annotations

import math
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

# mlx.launch runs a rank without ssh only on exactly this host name (RemoteProcess).
LOCAL_HOST = "127.0.0.1"


class HostUnreachable(RuntimeError):
    """A host mlx.launch must reach over ssh did not answer; the message names it and
    the fix."""


@dataclass(frozen=True)
class Host:
    rank: int
    ssh: str

    @property
    def local(self) -> bool:
        return self.ssh == LOCAL_HOST


def read_hosts(hostfile: str | None = None, hosts: str = LOCAL_HOST, n: int = 1) -> list[Host]:
    """The ranks' hosts exactly as mlx.launch reads them (its own parser)."""
    from mlx._distributed_utils.common import Hostfile

    hf = Hostfile.from_file(hostfile) if hostfile else Hostfile.from_list(hosts, n)
    return [Host(h.rank, h.ssh_hostname) for h in hf.hosts]


def ssh_command(host: str, timeout_s: float, command: str) -> list[str]:
    """``ssh`` that never asks (BatchMode) and gives up connecting after ``timeout_s``."""
    return [
        "ssh",
        "-o",
        "BatchMode=yes",
        "-o",
        f"ConnectTimeout={math.ceil(timeout_s)}",
        "-o",
        "LogLevel=ERROR",
        host,
        command,
    ]


def ssh_each(scripts: Mapping[str, str], timeout_s: float) -> dict[str, str | None]:
    """Run one command per host over ssh, all at once, each waited for at most
    ``timeout_s``: host -> None where it succeeded, else why (ssh's last stderr line,
    its exit code, or "no answer")."""
    procs = {
        host: subprocess.Popen(
            ssh_command(host, 5.0, command),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for host, command in scripts.items()
    }
    out: dict[str, str | None] = {}
    for host, p in procs.items():
        try:
            _, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            out[host] = "no answer"
            continue
        why = err.decode(errors="replace").strip().splitlines()
        out[host] = None if p.returncode == 0 else why[-1] if why else str(p.returncode)
    return out


def ssh_fix(host: str, error: str, python: str) -> str:
    """What to do about ``error`` from ssh to ``host`` (one sentence, the fix)."""
    e = error.lower()
    if "could not resolve" in e or "name or service not known" in e:
        return (
            f"correct the `ssh` name {host!r} in the hostfile (or make it resolve: "
            "~/.ssh/config, /etc/hosts)"
        )
    if "permission denied" in e:
        return f"install your key so ssh needs no password: ssh-copy-id {host}"
    if "host key verification failed" in e:
        return f"run `ssh {host}` once by hand and accept its host key"
    if "refused" in e:
        return (
            f"{host} answers but runs no ssh server: on a Mac turn on Remote Login "
            "(System Settings > General > Sharing)"
        )
    if "python" in e:
        return (
            f"put the same checkout and virtual environment at the same path on "
            f"{host}, or pass --python with its path there ({python} is missing)"
        )
    return (
        f"check that {host} is powered on and reachable from here (ping {host}), that "
        "the hostfile's `ssh` name is right, and that Remote Login is on"
    )


def probe_host(host: str, timeout_s: float = 5.0, python: str = sys.executable) -> str | None:
    """None when ``host`` answers ssh without a password and has ``python``; else what
    went wrong. Bounded: ssh's ConnectTimeout covers the connect and the handshake,
    and the whole probe is killed after ``timeout_s + 5`` s."""
    cmd = ssh_command(host, timeout_s, f"test -x {shlex.quote(python)} || exit 97")
    try:
        r = subprocess.run(
            cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s + 5
        )
    except FileNotFoundError:
        return "ssh is not installed on this machine (mlx.launch starts remote ranks with it)"
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout_s + 5:g} s"
    if r.returncode == 0:
        return None
    if r.returncode == 97:
        return f"python {python} is not there"
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    return lines[-1] if lines else f"ssh exited with code {r.returncode}"


def preflight_hosts(
    hosts: Sequence[Host],
    timeout_s: float = 5.0,
    python: str = sys.executable,
    source: str = "the hostfile",
) -> float:
    """Probe every remote host at once; raise HostUnreachable naming each that failed.
    Returns the seconds it took (at most about ``timeout_s + 5``)."""
    remote = sorted({h.ssh for h in hosts if not h.local})
    t0 = time.monotonic()
    if not remote:
        return 0.0
    with ThreadPoolExecutor(len(remote)) as pool:
        errors = dict(
            zip(remote, pool.map(lambda h: probe_host(h, timeout_s, python), remote), strict=True)
        )
    bad = {h: e for h, e in errors.items() if e is not None}
    dt = time.monotonic() - t0
    if bad:
        lines = []
        for h, e in bad.items():
            ranks = ", ".join(str(x.rank) for x in hosts if x.ssh == h)
            lines.append(
                f"host {h} (rank {ranks} in {source}) is unreachable over ssh ({e}); "
                f"fix: {ssh_fix(h, e, python)}"
            )
        raise HostUnreachable("; ".join(lines) + f" [checked in {dt:.1f} s; no rank was started]")
    return dt
