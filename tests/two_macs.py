"""README's two-Mac steps on the rig (tests/rig.py), adapted only in names and paths.

    .venv/bin/python tests/two_macs.py        # rig up, the walkthrough, rig down

1. rank folders made on mac1: rank 0 where it is served, rank 1 in mac1's staging folder;
2. rank 1's folder copied to mac2 over the cable with README's rsync line and verified
   there (``verify --mode full`` run over ssh);
3. the API key on mac1 only (``~/.k3dist-key`` in mac1's HOME);
4. the supervised launch on mac1: ``launch/run.py --hostfile <rig> -- launch/serve.py
   --config <deploy.yaml>``, through mlx.launch's real ssh path to both hosts;
5. a chat completion and an Anthropic Messages request from mac1 and from mac2;
6. SIGTERM to the supervisor: exit 0, no rank and no mlx.launch temp file left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rig as rigmod  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PY = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv").exists() else sys.executable
# the rig's ports (inside the namespaces: nothing else listens there)
API_PORT, RING_PORT, WATCHDOG_PORT = 22080, 22100, 22090
KEY = "k3h-test-key-0123456789abcdef"


@dataclass
class Site:
    """The walkthrough's folders: ``work/k3/rank{rank}`` is where each Mac serves from."""

    work: Path

    @property
    def rank_dir(self) -> str:
        return str(self.work / "k3" / "rank{rank}")

    @property
    def staging(self) -> Path:  # mac1's copy of rank 1 (README: made on the first Mac)
        return self.work / "mac1-out" / "rank1"

    @property
    def deploy(self) -> Path:
        return self.work / "deploy.yaml"


def make_site(rig: rigmod.Rig, build: Path, work: Path, **deploy) -> Site:
    """Steps 1-3: folders, rsync over the cable, verify on mac2, key on mac1, YAML."""
    from k3dist.pipeline import slicing

    site = Site(work)
    slicing.slice_rank(build, work / "k3" / "rank0", 0, 2, None, progress=False)
    slicing.slice_rank(build, site.staging, 1, 2, None, progress=False)
    dst = work / "k3" / "rank1"
    # README step: rsync -a --progress /Volumes/models/k3/rank1/ mac2:/Volumes/models/k3/rank1/
    r = rig.on(1, ["rsync", "-a", f"{site.staging}/", f"{rigmod.HOSTS[1]}:{dst}/"])
    assert r.returncode == 0, r.stderr
    r = rig.on(
        1,
        ["ssh", rigmod.HOSTS[1], f"{PY} -m k3dist.format.verify {dst} --mode full"],
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    key = rig.home(1) / ".k3dist-key"
    key.write_text(KEY + "\n")
    key.chmod(0o600)
    conf = {
        "rank_dir": site.rank_dir,
        "size": 2,
        "host": rigmod.ADDRS[0],
        "port": API_PORT,
        "api_key_file": "~/.k3dist-key",
        "watchdog_port": WATCHDOG_PORT,
        "watchdog_timeout_s": 5.0,
        "blas_threads": 1,
        **deploy,
    }
    site.deploy.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in conf.items()))
    return site


class Served:
    """Step 4: the supervised launch on mac1; output in ``log``."""

    def __init__(self, rig: rigmod.Rig, site: Site, *serve_args: str, run_args=()) -> None:
        self.rig, self.site = rig, site
        self.log_path = site.work / f"run-{time.monotonic_ns()}.log"
        self.t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    *rig.netns(1),
                    PY,
                    "launch/run.py",
                    "--hostfile",
                    str(rig.hostfile),
                    "-p",
                    str(RING_PORT),
                    *run_args,
                    "--",
                    "launch/serve.py",
                    "--config",
                    str(site.deploy),
                    *serve_args,
                ],
                cwd=REPO,
                env=rig.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while True:
            if m := re.search(pattern, self.output()):
                return m
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"exited {self.proc.returncode} before {pattern!r}:\n{self.output()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} within {timeout_s} s:\n{self.output()}")
            time.sleep(0.2)

    def wait_ready(self, timeout_s: float = 240.0) -> float:
        self.wait_for(r"k3dist: serving \S+ on http://", timeout_s)
        return time.monotonic() - self.t0

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout_s} s:\n{self.output()}") from None

    def stop(self) -> None:
        """SIGTERM (the supervisor stops the group); SIGKILL to its session if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def launcher_pid(self) -> int | None:
        """mlx.launch's pid (the supervisor's child)."""
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if any(c.endswith(b"mlx.launch") for c in cmd[:2]) and ppid_chain(ppid, self.proc.pid):
                return int(pid)
        return None


def ppid_chain(pid: int, ancestor: int, depth: int = 4) -> bool:
    for _ in range(depth):
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def client(rig: rigmod.Rig, host: int, key_file: Path, timeout_s: float = 120.0) -> dict:
    """Step 5 from mac``host``: tests/scripts/rig_client.py in its namespace."""
    r = rig.on(
        host,
        [
            PY,
            str(REPO / "tests/scripts/rig_client.py"),
            f"http://{rigmod.ADDRS[0]}:{API_PORT}",
            str(key_file),
            "--timeout-s",
            str(timeout_s),
        ],
        timeout=timeout_s * 3,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def launch_files_left(out: str) -> list[str]:
    """The mlx.launch temp files the ranks announced that still exist (shared FS)."""
    files = []
    for m in re.finditer(r"mlx\.launch files on this host: (.*)", out):
        files += m[1].split()
    return [f for f in files if Path(f).exists()]


def walkthrough(rig: rigmod.Rig, build: Path, work: Path) -> dict:
    """Steps 1-6; returns what was measured."""
    site = make_site(rig, build, work)
    served = Served(rig, site)
    result: dict = {}
    try:
        result["ready_s"] = round(served.wait_ready(), 1)
        out = served.output()
        assert "refusing to start" not in out, out
        key_file = rig.home(1) / ".k3dist-key"
        result["from_mac1"] = client(rig, 1, key_file)
        result["from_mac2"] = client(rig, 2, key_file)
        launcher = served.launcher_pid()
        assert launcher is not None, "mlx.launch not found"
        c0 = cpu_s(launcher)
        time.sleep(5.0)
        result["mlx_launch_idle_cpu_s_per_10s"] = round((cpu_s(launcher) - c0) * 2, 2)
    finally:
        t0 = time.monotonic()
        served.stop()
        result["stop_s"] = round(time.monotonic() - t0, 1)
    result["exit_code"] = served.proc.returncode
    out = served.output()
    result["launch_files_announced"] = len(re.findall(r"mlx\.launch files on this host", out))
    result["launch_files_left"] = launch_files_left(out)
    result["processes_left_on_mac2"] = [
        p for p in rig_pids(2) if p not in {rig.sshd[1].pid} and not is_sshd(p)
    ]
    result["output_tail"] = out[-3000:]
    return result


def rig_pids(host: int) -> list[int]:
    r = subprocess.run(
        ["ip", "netns", "pids", rigmod.HOSTS[host - 1]], capture_output=True, text=True
    )
    return [int(p) for p in r.stdout.split()]


def is_sshd(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "sshd"
    except OSError:
        return True  # gone


def main() -> int:
    from k3dist.pipeline import default

    os.chdir(REPO)
    build = default.ensure_default_build()
    rig = rigmod.Rig.up()
    try:
        res = walkthrough(rig, build, rig.root / "work")
    finally:
        rig.down()
    tail = res.pop("output_tail")
    print(tail)
    print(json.dumps(res, indent=2))
    ok = res["exit_code"] == 0 and not res["launch_files_left"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
