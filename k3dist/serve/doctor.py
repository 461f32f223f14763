"""Check every host of a hostfile over ssh before a launch: one line per check, each
failure with the command that fixes it; exit 1 when a launch would fail.

    k3dist-doctor --hostfile hostfiles/tb5.json --config deploy/tb5.yaml
    python -m k3dist.serve.doctor --hostfile hostfiles/tb5.json --config deploy/tb5.yaml

Each host answers one ssh call (``ssh -o BatchMode=yes -o ConnectTimeout=N HOST cd REPO
&& PYTHON -m k3dist.serve.doctor --probe ...``, all hosts at once, bounded): the probe
runs there and reports what it sees as one JSON line; the checks compare the hosts here.

- ssh without a password, the interpreter and the repo at the same path (mlx.launch starts
  ``PYTHON`` in this checkout's path on every host); the same k3dist, mlx and mlx-lm
  versions everywhere;
- the rank's folder (the deployment's ``rank_dir``) and its manifest verified (``stamp``:
  a few stat calls for a folder stamped since; k3dist.format.verify);
- the API key file on rank 0's host when the server is reachable from other machines
  (only rank 0 answers HTTP; the others need none);
- ports free on each host's ring address: the ring ports, the watchdog's, the API's;
- each host reaching the others' ring addresses (a TCP connect: refused means reached);
- free memory against the rank's weights + memory_headroom_gib, and on macOS
  ``iogpu.wired_limit_mb`` against the same;
- for a JACCL hostfile: macOS 26.2 or later, Thunderbolt 5 (TB4 cannot do RDMA), RDMA
  enabled (``rdma_ctl status``), the RDMA devices the hostfile names present
  (``ibv_devices``) and linked (``ibv_devinfo``: PORT_ACTIVE; a Mac lists a device for
  every Thunderbolt port, cabled or not), and the same ``MLX_*`` /
  ``JACCL_*`` environment on every host (an asymmetric MLX_METAL_FAST_SYNCH crashed a
  4-box cluster, mlx#3933);
- sleep disabled (``pmset -g``: sleep 0) on macOS; clock skew under 2 s (the probe's clock
  at its start, against the ssh round trip less the probe's own run time); free disk
  where the prefix cache is written.

``--fast``: ssh, interpreter, repo, versions, rank folders (size mode), key, ports: what
``launch/run.py`` runs before it starts mlx.launch. mlx ships the Thunderbolt set-up
itself (``mlx.distributed_config --over thunderbolt --backend jaccl --auto-setup``): the
doctor does not repeat it and names it as the fix. macOS-only probes parse the output of
``sw_vers``, ``sysctl``, ``pmset``, ``vm_stat``, ``system_profiler``, ``ibv_devices``,
``ibv_devinfo`` and ``rdma_ctl`` (k3dist.serve.macos; tests/serve/macos_outputs: the
outputs recorded on Macs it is tested against, and where each came from).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from k3dist.serve import macos

# mlx.launch's default --starting-port (ring: +1 per rank and address)
RING_PORT = 32323
JACCL_MIN_MACOS = (26, 2)
CLOCK_SKEW_S = 2.0
MIN_FREE_DISK_GB = 10.0
ENV_PREFIXES = ("MLX_", "JACCL_")


@dataclass
class Check:
    host: str
    name: str
    ok: bool
    detail: str
    fix: str = ""
    fatal: bool = True  # a failure that would make the launch fail (else a warning)

    def line(self) -> str:
        tag = "ok  " if self.ok else ("FAIL" if self.fatal else "warn")
        fix = f" -- fix: {self.fix}" if (self.fix and not self.ok) else ""
        return f"[{tag}] {self.host}: {self.name}: {self.detail}{fix}"


# ------------------------------------------------------------------ the probe (remote)


def _cmd(args: list[str], timeout: float = 10.0) -> str | None:
    if not shutil.which(args[0]):
        return None
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout


def _port_free(addr: str, port: int) -> str | None:
    """None when ``addr:port`` can be bound, else why not."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
            return None
        except OSError as e:
            return e.strerror or str(e)


def _reach(addr: str, port: int, timeout: float = 2.0) -> str | None:
    """None when ``addr`` answers on ``port`` (listening or refusing), else why not."""
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return None
    except ConnectionRefusedError:
        return None  # the host answered: nothing listens yet, which is expected
    except OSError as e:
        return e.strerror or str(e) or type(e).__name__


def probe(req: dict) -> dict:
    """What this host sees (run on each host by ssh): JSON-able facts."""
    import importlib.metadata as md

    out: dict = {"t0": time.time(), "cwd": os.getcwd(), "python": sys.executable}
    out["system"] = platform.system()
    for pkg in ("k3dist", "mlx", "mlx-lm"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    try:
        import k3dist

        out["k3dist_path"] = str(Path(k3dist.__file__).resolve().parents[1])
    except ImportError:
        out["k3dist_path"] = None
    out["env"] = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    # the rank folder(s) of this host
    folders = {}
    for rank, folder in req.get("folders", {}).items():
        folders[rank] = _probe_folder(Path(folder), req.get("verify", "stamp"))
    out["folders"] = folders
    key = req.get("key_file")
    if key:
        p = Path(key).expanduser()
        out["key"] = {"path": str(p), "exists": p.is_file()}
        if p.is_file():
            lines = p.read_text().strip().splitlines()
            out["key"]["usable"] = bool(lines and len(lines[0].strip()) >= 8)
    out["ports"] = {
        f"{a}:{p}": _port_free(a, p) for a, p in (tuple(x) for x in req.get("ports", []))
    }
    out["reach"] = {f"{a}:{p}": _reach(a, p) for a, p in (tuple(x) for x in req.get("reach", []))}
    if not req.get("fast"):
        out["mem_available"] = _mem_available(out["system"])
        disk = Path(req.get("disk_path") or ".").expanduser()
        while not disk.exists() and disk != disk.parent:
            disk = disk.parent
        out["disk_free"] = shutil.disk_usage(disk).free
        out["disk_path"] = str(disk)
        if out["system"] == "Darwin":
            out["sw_vers"] = _cmd(["sw_vers", "-productVersion"])
            out["wired_limit_mb"] = _cmd(["sysctl", "iogpu.wired_limit_mb"])  # as recorded
            out["pmset"] = _cmd(["pmset", "-g"])
            out["mem_total"] = _cmd(["sysctl", "-n", "hw.memsize"])
            if req.get("jaccl"):
                out["thunderbolt"] = _cmd(
                    ["system_profiler", "SPThunderboltDataType", "-json"], timeout=30
                )
                out["ibv_devices"] = _cmd(["ibv_devices"])
                out["ibv_devinfo"] = _cmd(["ibv_devinfo"])
                out["rdma_ctl"] = _cmd(["rdma_ctl", "status"])
    out["t"] = time.time()
    return out


def _probe_folder(folder: Path, mode: str) -> dict:
    from k3dist.format import verify
    from k3dist.format.manifest import MANIFEST

    if not (folder / MANIFEST).is_file():
        return {"ok": False, "why": f"{folder / MANIFEST} is missing"}
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        report = verify.verify_folder(folder, manifest, mode)
        size = sum(int(m["bytes"]) for m in manifest["files"].values())
        return {"ok": True, "why": report.summary(), "bytes": size}
    except Exception as e:  # noqa: BLE001 - any failure is the answer
        return {"ok": False, "why": f"{type(e).__name__}: {e}"}


def _mem_available(system: str) -> int | None:
    if system == "Linux":
        m = re.search(r"MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text())
        return int(m[1]) * 1024 if m else None
    if system == "Darwin":
        text = _cmd(["vm_stat"])
        return macos.parse_vm_stat(text) if text else None
    return None


# ------------------------------------------------------------------ the checks (here)


@dataclass
class Plan:
    hosts: list  # mlx Host: rank, ssh_hostname, ips, rdma
    backend: str
    envs: list[str]
    dep: object  # Deployment
    ring_port: int
    python: str
    repo: str
    fast: bool


def _remote(host: str, python: str, repo: str, req: dict, timeout_s: float) -> tuple[dict, str]:
    """(facts, error): one ssh call running the probe on ``host``."""
    cmd = (
        f"cd {shlex.quote(repo)} || exit 96; test -x {shlex.quote(python)} || exit 97; "
        f"exec {shlex.quote(python)} -m k3dist.serve.doctor --probe {shlex.quote(json.dumps(req))}"
    )
    if host == "127.0.0.1":
        args = ["bash", "-c", cmd]
    else:
        args = [
            "ssh",
            "-o",
            "BatchMode=yes",
            "-o",
            f"ConnectTimeout={int(timeout_s)}",
            "-o",
            "LogLevel=ERROR",
            host,
            cmd,
        ]
    t0 = time.time()  # the probe's clock is read between t0 and the answer
    try:
        r = subprocess.run(
            args, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s + 60
        )
    except subprocess.TimeoutExpired:
        return {}, f"no answer within {timeout_s + 60:g} s"
    if r.returncode == 96:
        return {}, f"the repo path {repo} is not there"
    if r.returncode == 97:
        return {}, f"python {python} is not there"
    if r.returncode != 0:
        lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
        return {}, lines[-1] if lines else f"exit {r.returncode}"
    facts = json.loads(r.stdout.strip().splitlines()[-1])
    facts["sent"], facts["answered"] = t0, time.time()
    return facts, ""


def _requests(plan: Plan) -> dict[str, dict]:
    """Per ssh host: what its probe must look at."""
    dep = plan.dep
    by_host: dict[str, dict] = {}
    port = plan.ring_port
    ring: list[tuple[str, int]] = []  # (ip, port) per rank, as mlx.launch assigns them
    for h in plan.hosts:
        for ip in h.ips:
            ring.append((ip, port))
            port += 1
    wd_port = dep.watchdog_port or (plan.ring_port + 1000)
    for h in plan.hosts:
        req = by_host.setdefault(
            h.ssh_hostname,
            {"folders": {}, "ports": [], "reach": [], "fast": plan.fast, "jaccl": False},
        )
        req["jaccl"] = plan.backend.startswith("jaccl")
        req["verify"] = "size" if plan.fast else "stamp"
        req["folders"][str(h.rank)] = str(dep.rank_path(h.rank))
        req["ports"] += [(ip, p) for ip, p in ring if ip in h.ips]
        if h.rank == 0:
            addr0 = h.ips[0] if h.ips else "0.0.0.0"
            req["ports"].append((addr0, wd_port))
            req["ports"].append((dep.host if dep.host != "0.0.0.0" else "0.0.0.0", dep.port))
            if dep.api_key_file:
                req["key_file"] = dep.api_key_file
        req["reach"] += [(ip, p) for ip, p in ring if ip not in h.ips]
        req["disk_path"] = dep.prefix_cache_dir or str(dep.rank_path(h.rank))
    return by_host


def run_checks(plan: Plan, timeout_s: float = 5.0) -> list[Check]:
    """Every check of the plan's hosts: one ssh per host, all at once, bounded by
    ``timeout_s``; a host ssh cannot reach gets its one failed check with the fix."""
    reqs = _requests(plan)
    names = list(reqs)
    with ThreadPoolExecutor(len(names)) as pool:
        got = dict(
            zip(
                names,
                pool.map(lambda h: _remote(h, plan.python, plan.repo, reqs[h], timeout_s), names),
                strict=True,
            )
        )
    checks: list[Check] = []
    facts = {h: f for h, (f, err) in got.items() if not err}
    for h, (_, err) in got.items():
        if not err:
            checks.append(
                Check(h, "ssh", True, "answers without a password; python and repo there")
            )
            continue
        from k3dist.serve.hosts import ssh_fix

        fix = ssh_fix(h, err, plan.python)
        if "repo path" in err:
            fix = f"put this checkout at {plan.repo} on {h} (git clone, the same path)"
        checks.append(Check(h, "ssh", False, err, fix))
    if not facts:
        return checks
    ref_host = names[0] if names[0] in facts else next(iter(facts))
    ref = facts[ref_host]
    for h, f in facts.items():
        checks += _host_checks(h, f, ref_host, ref, plan)
    if not plan.fast:
        checks += _cluster_checks(facts, plan, ref_host)
    return checks


def _host_checks(h: str, f: dict, ref_host: str, ref: dict, plan: Plan) -> list[Check]:
    """One reachable host's checks: versions as ``ref_host``'s, the repo path, its rank
    folders, rank 0's key, its ports, what it reaches, and (not --fast) its resources."""
    from k3dist.serve import auth

    dep = plan.dep
    out: list[Check] = []
    for pkg in ("k3dist", "mlx", "mlx-lm"):
        same = f[pkg] == ref[pkg] and f[pkg] is not None
        out.append(
            Check(
                h,
                f"{pkg} version",
                same,
                f"{f[pkg]}" + ("" if same else f" ({ref_host} has {ref[pkg]})"),
                f"ssh {h} 'cd {plan.repo} && {plan.python} -m pip install -e .' "
                "(the same commit and pins everywhere)",
            )
        )
    same_path = f.get("k3dist_path") == plan.repo
    out.append(
        Check(
            h,
            "repo path",
            same_path,
            f"k3dist imported from {f.get('k3dist_path')}",
            f"install this checkout at {plan.repo} on {h} (pip install -e .)",
        )
    )
    for rank, folder in f["folders"].items():
        path = dep.rank_path(int(rank))
        out.append(
            Check(
                h,
                f"rank {rank} folder",
                folder["ok"],
                f"{path}: {folder['why']}",
                f"rsync -a --progress {path}/ {h}:{path}/  (from the Mac that sliced it), "
                f"then ssh {h} {plan.python} -m k3dist.format.verify {path} --mode full",
            )
        )
    if "key" in f:
        k = f["key"]
        exposed = not auth.is_loopback(dep.host) and not dep.allow_no_api_key
        ok = k["exists"] and k.get("usable", False)
        out.append(
            Check(
                h,
                "API key (rank 0)",
                ok or not exposed,
                f"{k['path']}: "
                + ("present" if ok else "missing" if not k["exists"] else "empty or short"),
                f"ssh {h} 'openssl rand -hex 24 > {dep.api_key_file} && chmod 600 "
                f"{dep.api_key_file}'",
            )
        )
    for where, why in f["ports"].items():
        out.append(
            Check(
                h,
                f"port {where}",
                why is None,
                "free" if why is None else f"cannot bind: {why}",
                f"ssh {h} lsof -nP -iTCP:{where.rsplit(':', 1)[1]} -sTCP:LISTEN  (stop it, "
                "or choose other ports: run.py -p, watchdog_port, port)",
            )
        )
    for where, why in f["reach"].items():
        out.append(
            Check(
                h,
                f"reaches {where}",
                why is None,
                "answers" if why is None else why,
                f"check the cable and both hosts' bridge addresses (ssh {h} ping -c 1 "
                f"{where.rsplit(':', 1)[0]}); mlx.distributed_config --over thunderbolt "
                "sets them up",
            )
        )
    if not plan.fast:
        out += _resource_checks(h, f, plan) + _box_checks(h, f, plan)
    return out


def _box_checks(h: str, f: dict, plan: Plan) -> list[Check]:
    """Where the deployment lists its boxes (memory and wired limit, rank order): each
    rank's Mac has that memory and at least that wired limit, what the plan budgeted."""
    from k3dist.config.box import sized
    from k3dist.format.kvmemory import GiB

    boxes = plan.dep.boxes
    total = macos.parse_sysctl_int(f.get("mem_total") or "")
    limit = macos.parse_sysctl_int(f.get("wired_limit_mb") or "")
    if not boxes or total is None:
        return []
    out = []
    for rank in sorted(f["folders"], key=int):
        box = boxes[int(rank)]
        want = box.wired_limit_mb or sized(box.memory_gib).wired_limit_mb
        out.append(
            Check(
                h,
                f"rank {rank} box memory",
                abs(total - box.memory_gib * GiB) < GiB,
                f"{total / GiB:g} GiB here, the deployment lists {box.memory_gib:g} GiB",
                "list the deployment's boxes in the hostfile's rank order",
            )
        )
        if limit is not None:
            out.append(
                Check(
                    h,
                    f"rank {rank} wired limit",
                    limit >= want,
                    f"iogpu.wired_limit_mb {limit}; the deployment's box (the plan) {want}",
                    f"ssh {h} sudo sysctl iogpu.wired_limit_mb={want}",
                )
            )
    return out


def clock_skew(remote_t0: float, remote_t1: float, sent: float, answered: float) -> float:
    """How far the remote clock is outside the window in which it was read (0 inside).
    The probe reads it as it starts (``remote_t0``) and ends (``remote_t1``): its start
    lies between the ssh call (``sent``) and the answer less the probe's own run time,
    so a probe that hashes a folder or waits on system_profiler for 30 s does not widen
    the window by 30 s (a clock that far behind would be read inside it)."""
    work = max(0.0, remote_t1 - remote_t0)
    latest = max(sent, answered - work)
    return max(0.0, sent - remote_t0, remote_t0 - latest)


def _need_bytes(f: dict, plan: Plan) -> int:
    from k3dist.format.kvmemory import GiB

    weights = sum(x.get("bytes", 0) for x in f["folders"].values())
    return weights + int(plan.dep.memory_headroom_gib * GiB) * len(f["folders"])


def _resource_checks(h: str, f: dict, plan: Plan) -> list[Check]:
    out = []
    need = _need_bytes(f, plan)
    gb = 1e9
    avail = f.get("mem_available")
    if avail is not None:
        out.append(
            Check(
                h,
                "free memory",
                avail >= need,
                f"{avail / gb:.1f} GB available, the plan needs {need / gb:.1f} GB "
                "(rank folders + memory_headroom_gib)",
                "close other programs, or lower memory_headroom_gib / max_batch",
            )
        )
    limit = macos.parse_sysctl_int(f.get("wired_limit_mb") or "")
    if limit is not None:
        total = macos.parse_sysctl_int(f.get("mem_total") or "") or 0
        mb = limit * 1024 * 1024 if limit else int(total * 0.75)  # macOS default ~75 %
        out.append(
            Check(
                h,
                "iogpu.wired_limit_mb",
                mb >= need,
                f"{limit} MB ({'set' if limit else 'default, ~75% of memory'}): "
                f"{mb / gb:.1f} GB wired allowed, the plan needs {need / gb:.1f} GB",
                f"ssh {h} sudo sysctl iogpu.wired_limit_mb={need // (1024 * 1024) + 4096}",
            )
        )
    if f.get("pmset") is not None:
        pm = macos.parse_pmset(f["pmset"])
        out.append(
            Check(
                h,
                "sleep disabled",
                macos.never_sleeps(f["pmset"]),
                f"pmset sleep {pm['sleep']}, SleepDisabled {int(pm['sleep_disabled'])}",
                f"ssh {h} sudo pmset -a sleep 0 disksleep 0",
                fatal=False,
            )
        )
    skew = clock_skew(f.get("t0", f["t"]), f["t"], f["sent"], f["answered"])
    out.append(
        Check(
            h,
            "clock skew",
            skew < CLOCK_SKEW_S,
            f"{skew:.2f} s from this machine",
            f"ssh {h} sudo sntp -sS time.apple.com",
            fatal=False,
        )
    )
    free = f.get("disk_free")
    if free is not None:
        out.append(
            Check(
                h,
                "free disk",
                free >= MIN_FREE_DISK_GB * gb,
                f"{free / gb:.1f} GB free at {f['disk_path']}",
                "free space there or set prefix_cache_dir elsewhere",
                fatal=False,
            )
        )
    if plan.backend.startswith("jaccl"):
        out += _jaccl_checks(h, f, plan)
    return out


def _jaccl_checks(h: str, f: dict, plan: Plan) -> list[Check]:
    out = []
    ver = macos.parse_sw_vers(f.get("sw_vers") or "")
    out.append(
        Check(
            h,
            "macOS for JACCL",
            ver is not None and ver >= JACCL_MIN_MACOS,
            f"macOS {'.'.join(map(str, ver)) if ver else 'unknown'} (JACCL needs 26.2+)",
            "Software Update to macOS 26.2 or later, or use the ring hostfile (tb5.json)",
        )
    )
    tb = macos.parse_thunderbolt(f["thunderbolt"]) if f.get("thunderbolt") else []
    linked = [p["speed"] for p in tb if p["connected"]]
    out.append(
        Check(
            h,
            "Thunderbolt 5",
            bool(linked) and all(macos.tb_generation(s) == 5 for s in linked),
            f"links to another Mac: {linked or 'none'}",
            "a Thunderbolt 5 cable between Thunderbolt 5 ports (TB4 cannot do RDMA)",
        )
    )
    return out + _rdma_checks(h, f, plan)


def _rdma_checks(h: str, f: dict, plan: Plan) -> list[Check]:
    """RDMA enabled, the hostfile's devices listed, and linked: a Mac lists an rdma_enN
    for every Thunderbolt port, and only the cabled one's port is PORT_ACTIVE (a device
    whose port is down fails JACCL's set-up)."""
    setup = "mlx.distributed_config --over thunderbolt --backend jaccl --auto-setup"
    status = macos.parse_rdma_ctl(f.get("rdma_ctl") or "")
    states = macos.parse_ibv_devinfo(f.get("ibv_devinfo") or "")
    listed = macos.parse_ibv_devices(f.get("ibv_devices") or "")
    devs = listed + [d for d in states if d not in listed]  # either command lists a device
    host = next(x for x in plan.hosts if x.ssh_hostname == h)
    named = [x for d in host.rdma if d for x in (d if isinstance(d, list) else [d])]
    missing = [d for d in named if d not in devs]
    why = f"rdma_ctl status: {status or 'unknown'}; devices: {devs or 'none'}"
    fix = "enable RDMA in Recovery (rdma_ctl enable), reboot, then " + setup
    if status == "enabled" and not devs:
        fix = "RDMA is enabled but no device is listed: shut both Macs down and start them again"
    out = [
        Check(
            h, "RDMA devices", bool(devs) and not missing, f"{why}; the hostfile names {named}", fix
        )
    ]
    if devs and not missing and states:
        down = {
            d: states.get(d, "not in ibv_devinfo") for d in named if states.get(d) != "PORT_ACTIVE"
        }
        active = [d for d, st in states.items() if st == "PORT_ACTIVE"]
        out.append(
            Check(
                h,
                "RDMA ports linked",
                not down,
                f"the hostfile's devices not PORT_ACTIVE: {down}; active: {active}"
                if down
                else f"{named} PORT_ACTIVE",
                "the cable is in another port: rewrite the hostfile with " + setup,
            )
        )
    return out


def _cluster_checks(facts: dict, plan: Plan, ref_host: str) -> list[Check]:
    out = []
    if plan.backend.startswith("jaccl") or any(f["env"] for f in facts.values()):
        ref = facts[ref_host]["env"]
        for h, f in facts.items():
            diff = sorted(k for k in set(ref) | set(f["env"]) if ref.get(k) != f["env"].get(k))
            out.append(
                Check(
                    h,
                    "MLX_*/JACCL_* environment",
                    not diff,
                    "same as " + ref_host if not diff else f"differs from {ref_host}: {diff}",
                    "set them once in the hostfile's envs (mlx.launch passes those to every "
                    "rank) and remove them from the hosts' shell profiles",
                )
            )
    return out


def plan_from(
    hostfile: str, config: str | None, python: str, repo: str, ring_port: int, fast: bool
) -> Plan:
    from k3dist.config.deployment import load_deployment

    from mlx._distributed_utils.common import Hostfile

    hf = Hostfile.from_file(hostfile)
    dep = load_deployment(config)
    return Plan(hf.hosts, hf.backend or "ring", hf.envs, dep, ring_port, python, repo, fast)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hostfile", help="mlx.launch hostfile (hostfiles/*.json)")
    ap.add_argument("--config", help="deployment YAML (deploy/*.yaml)")
    ap.add_argument("--python", default=sys.executable, help="the ranks' interpreter")
    ap.add_argument("--repo", default=os.getcwd(), help="the checkout, at this path everywhere")
    ap.add_argument("-p", "--starting-port", type=int, default=RING_PORT, help="mlx.launch -p")
    ap.add_argument("--timeout-s", type=float, default=5.0, help="ssh connect timeout")
    ap.add_argument("--fast", action="store_true", help="the subset launch/run.py runs")
    ap.add_argument("--probe", help=argparse.SUPPRESS)  # run on each host by the doctor
    args = ap.parse_args(argv)
    if args.probe is not None:
        print(json.dumps(probe(json.loads(args.probe))), flush=True)
        return 0
    if not args.hostfile:
        ap.error("--hostfile is required")
    plan = plan_from(
        args.hostfile,
        args.config,
        args.python,
        str(Path(args.repo).resolve()),
        args.starting_port,
        args.fast,
    )
    checks = run_checks(plan, args.timeout_s)
    for c in checks:
        print(c.line(), flush=True)
    bad = [c for c in checks if not c.ok and c.fatal]
    warn = [c for c in checks if not c.ok and not c.fatal]
    print(
        f"k3dist-doctor: {len(checks)} checks, {len(bad)} failed, {len(warn)} warnings: "
        + ("a launch would fail" if bad else "ready to launch"),
        flush=True,
    )
    if not bad and not args.fast:
        print(launch_hint(args.hostfile, args.config), flush=True)
    return 1 if bad else 0


def launch_hint(hostfile: str, config: str | None) -> str:
    """The supervised launch: plain ``mlx.launch`` over ssh spins a core per rank and
    cannot kill its remote ranks (docs/two-hosts.md); ``launch/run.py`` fixes both."""
    conf = f" --config {config}" if config else ""
    return (
        f"launch with: .venv/bin/python launch/run.py --hostfile {hostfile} -- "
        f"launch/serve.py{conf}  (not plain mlx.launch over ssh: docs/two-hosts.md)"
    )


if __name__ == "__main__":
    sys.exit(main())
