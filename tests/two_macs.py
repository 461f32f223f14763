"""README's two-Mac checklist on the rig (tests/rig.py): the commands are read from
README.md's table (tests/doc_blocks.py) and run on their Mac's namespace as written, or
named with the one-line reason they cannot run on Linux (NOT_ON_LINUX).

    .venv/bin/python tests/two_macs.py        # rig up, the checklist, a request, rig down

What is substituted in a command, and nothing else (``on_rig``):

- the names and bridge addresses of hostfiles/tb5.json -> the rig's (mac-studio-1.local ->
  k3h-mac1, 10.10.0.2 -> 10.77.0.2, ...);
- ``/Volumes/`` on Mac h -> ``<work>/host{h-1}/Volumes/``: each Mac its own disk on the
  one filesystem both namespaces share (a path after ``10.10.0.2:`` or in ``ssh
  10.10.0.2 ...`` is Mac 2's);
- ``hostfiles/tb5.json`` and ``deploy/tb5.yaml`` -> copies with the same substitutions
  (the deployment's ``rank_dir`` names each rank's own host folder with ``{rank}``: rank
  r runs on host r), plus RIG_KEYS (memory, dtype, watchdog time-out, threads: what a
  2-core Linux machine needs that two Macs do not);
- the download -> the shipped mini-K3 (``k3dist/data/mini-k3``) linked where it would land.

Each command runs from the checkout (both "Macs" share it and its .venv) with HOME the
Mac's own (``rig.home``). The pipeline command runs as written; on the 12M-parameter mini
at a 512 GB Mac's budget the planner either refuses it (a lo format outside the quality
grid) or, on the merged grid, plans a build inside the mini-K3 grid. By hand it runs to
its end (~3 min here) and its rank folders are the ones copied and served; in the suite
it is stopped once it has printed its plan and disk plan (the build resumes where it
stopped; the pipeline on the mini: tests/pipeline/test_pipeline.py), and a rank folder it
did not write is the mini's build sliced into its OUT.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import doc_blocks  # noqa: E402
import rig as rigmod  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PY = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv").exists() else sys.executable
TB5_HOSTS = json.loads((REPO / "hostfiles" / "tb5.json").read_text())["hosts"]
TB5 = yaml.safe_load((REPO / "deploy" / "tb5.yaml").read_text())
API_PORT = TB5["port"]
RING_PORT = 32323  # mlx.launch's base port (k3dist.serve.watchdog.DEFAULT_RING_PORT)

# deploy/tb5.yaml's keys the rig changes beyond names and paths, and why
RIG_KEYS = {
    "memory_headroom_gib": 2.0,  # sized for a 512 GB Mac; this machine has 24 GB for all
    "dtype": "float32",  # bfloat16 is Metal's choice; CPU bf16 matmuls are ~10x slower
    "watchdog_timeout_s": 5.0,  # the cable-pull test's bound (tests/serve/test_two_hosts.py)
    "blas_threads": 1,  # both hosts share 2 cores
}

# Commands that cannot run on Linux: what they need, one line each (matched in the text)
NOT_ON_LINUX = {
    "systemsetup": "macOS's Remote Login; the rig's hosts run sshd already (tests/rig.py)",
    "scripts/setup": "installs packages from the network; both hosts share this checkout's "
    ".venv (scripts/setup is what .ci/run runs)",
    "networksetup": "macOS's network settings; tests/rig.py gives the cable's ends these "
    "addresses (ip addr add)",
    "ssh-keygen": "makes the user's key once; the rig's key is made by tests/rig.py and "
    "put in mac1's ~/.ssh",
    "iogpu": "macOS's GPU wired limit (sysctl iogpu.*): Linux has none; its value is the "
    "planner's budget (tests/test_docs.py)",
    "pfctl": "macOS's pf firewall; the anchor's addresses and ports are checked by "
    "tests/test_docs.py, a blocked ring port by tests/serve/test_two_hosts.py's doctor test",
    "rdma_ctl": "JACCL's RDMA is enabled in macOS Recovery; the rig runs the ring backend",
}
SERVE = "launch/run.py"  # the serve step's command; started by Served, not run to its end


@dataclass
class Command:
    """One command of the checklist: its step, its Mac(s) and its text as written."""

    step: int
    hosts: tuple[int, ...]
    text: str

    @property
    def why_not(self) -> str | None:
        return next((why for key, why in NOT_ON_LINUX.items() if key in self.text), None)


def checklist() -> list[Command]:
    """README's table, command by command, in order."""
    out = []
    for row in doc_blocks.guide_table():
        hosts = {"Mac 1": (1,), "Mac 2": (2,), "both": (1, 2)}[row[1]]
        out += [Command(int(row[0]), hosts, c) for c in doc_blocks.row_commands(row)]
    return out


@dataclass
class Site:
    """The rig's Macs: ``work/host{r}`` is the disk of the Mac running rank r."""

    rig: rigmod.Rig
    work: Path
    log: list[dict] = field(default_factory=list)  # what each step did

    def volumes(self, host: int) -> str:
        return f"{self.work}/host{host - 1}/Volumes/"

    @property
    def hostfile(self) -> Path:
        return self.work / "tb5.json"

    @property
    def deploy(self) -> Path:
        return self.work / "tb5.yaml"

    def rank_folder(self, rank: int) -> Path:
        """The folder rank ``rank`` serves from, on its own host."""
        return Path(yaml.safe_load(self.deploy.read_text())["rank_dir"].format(rank=rank))

    def on_rig(self, text: str, host: int) -> str:
        """A README command as it runs on mac``host``: names and paths substituted."""
        for i, h in enumerate(TB5_HOSTS):
            ip, vol = h["ips"][0], self.volumes(i + 1)
            text = text.replace(f"{ip}:/Volumes/", f"{ip}:{vol}")
            text = re.sub(rf"(ssh {re.escape(ip)} [^&|;]*?)/Volumes/", rf"\g<1>{vol}", text)
        text = re.sub(r"(?<![\w.-])/Volumes/", self.volumes(host), text)  # not a done one
        for i, h in enumerate(TB5_HOSTS):
            text = text.replace(h["ssh"], rigmod.HOSTS[i])
            text = text.replace(h["ips"][0], rigmod.ADDRS[i])
        text = text.replace("hostfiles/tb5.json", str(self.hostfile))
        return text.replace("deploy/tb5.yaml", str(self.deploy))

    def env(self, host: int) -> dict:
        return self.rig.env({**os.environ, "HOME": str(self.rig.home(host))})

    def run(self, cmd: Command, host: int, timeout: float = 120) -> subprocess.CompletedProcess:
        text = self.on_rig(cmd.text, host)
        t0 = time.monotonic()
        r = self.rig.on(host, ["bash", "-ec", text], cwd=REPO, env=self.env(host), timeout=timeout)
        self.log.append(
            {"step": cmd.step, "mac": host, "ran": text, "rc": r.returncode,
             "s": round(time.monotonic() - t0, 1)}
        )  # fmt: skip
        return r


def _write_configs(site: Site, deploy: dict) -> None:
    """tb5.json and tb5.yaml with the rig's names and paths (and RIG_KEYS, ``deploy``)."""
    site.hostfile.write_text(site.on_rig((REPO / "hostfiles/tb5.json").read_text(), 1))
    conf = yaml.safe_load(site.on_rig((REPO / "deploy/tb5.yaml").read_text(), 1))
    conf["rank_dir"] = conf["rank_dir"].replace(
        site.volumes(1), f"{site.work}/host{{rank}}/Volumes/"
    )
    conf.update(RIG_KEYS, **deploy)
    site.deploy.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in conf.items()))


PIPELINE_END_S = 900  # by hand, the whole pipeline on the mini: ~3 min on 2 loaded cores


def _pipeline_step(site: Site, cmd: Command, build: Path, to_end: bool) -> None:
    """The pipeline as written, on mac1. On the mini at a 512 GB Mac's budget the planner
    either refuses (a lo format outside the quality grid) or plans a build inside the
    mini-K3 grid (the merged grid does). In the suite it is stopped (SIGTERM to its
    session) once it has printed its plan and disk plan: the build itself is tested in
    tests/pipeline and resumes where it stopped. By hand (``to_end``) it runs to its end
    and its own rank folders are the ones copied and served. A rank folder it did not
    write is the mini's build sliced into its OUT."""
    from k3dist.pipeline import slicing

    text = site.on_rig(cmd.text, 1)
    argv = shlex.split(text)
    out = Path(argv[argv.index("--out") + 1])
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [*site.rig.netns(1), "bash", "-ec", text],
        cwd=REPO,
        env=site.env(1),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    stopped = False
    try:
        if not to_end:
            deadline = t0 + 120
            while proc.poll() is None and not any(x.startswith("[1/") for x in lines):
                assert time.monotonic() < deadline, "no plan within 120 s:\n" + "".join(lines)
                time.sleep(0.2)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                stopped = True
        proc.wait(PIPELINE_END_S if to_end else 60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    reader.join(10)
    said = "".join(lines)
    site.log.append(
        {"step": cmd.step, "mac": 1, "ran": text, "rc": proc.returncode,
         "s": round(time.monotonic() - t0, 1), "stopped_after_its_plan": stopped}
    )  # fmt: skip
    # the planner refuses a lo format outside the quality grid, or plans one inside it
    assert "quality grid" in said or "mini-K3 grid" in said, said[-3000:]
    if to_end and "plan: " in said:
        assert proc.returncode == 0, said[-3000:]
    for rank in (0, 1):
        if not (out / f"rank{rank}").exists():
            slicing.slice_rank(build, out / f"rank{rank}", rank, 2, None, progress=False)


def make_site(
    rig: rigmod.Rig, build: Path, work: Path, pipeline_to_end: bool = False, **deploy
) -> Site:
    """The checklist up to the serve step, on the rig; ``deploy``: deployment keys over
    tb5.yaml's (the tests' own, e.g. ``warmup``); ``pipeline_to_end``: the pipeline step
    runs to its end (by hand) instead of stopping after its plan (the suite)."""
    site = Site(rig, work)
    work.mkdir(parents=True, exist_ok=True)
    _write_configs(site, deploy)
    ssh = rig.home(1) / ".ssh"  # the key README's step makes when there is none
    ssh.mkdir(mode=0o700)
    for name, src in (("id_ed25519", "client"), ("id_ed25519.pub", "client.pub")):
        (ssh / name).write_bytes((rig.root / "keys" / src).read_bytes())
    (ssh / "id_ed25519").chmod(0o600)
    download = Path(site.volumes(1)) / "models" / "Kimi-K3"
    download.parent.mkdir(parents=True)
    download.symlink_to(REPO / "k3dist" / "data" / "mini-k3")
    for cmd in checklist():
        if SERVE in cmd.text:
            return site
        if cmd.why_not:
            site.log.append({"step": cmd.step, "not run": cmd.text, "why": cmd.why_not})
            continue
        if "k3dist-pipeline" in cmd.text:
            _pipeline_step(site, cmd, build, pipeline_to_end)
            continue
        for host in cmd.hosts:
            r = site.run(cmd, host)
            assert r.returncode == 0, f"step {cmd.step} on mac{host}:\n{r.stdout}{r.stderr}"
            if "k3dist-doctor" in cmd.text:
                assert "ready to launch" in r.stdout, r.stdout
    raise AssertionError(f"README's checklist has no {SERVE} step")


def after_serve(site: Site) -> list[str]:
    """The checklist's steps after the serve step (the health checks), run on their Mac:
    what each printed."""
    cmds = checklist()
    i = next(i for i, c in enumerate(cmds) if SERVE in c.text)
    out = []
    for cmd in cmds[i + 1 :]:
        for host in cmd.hosts:
            r = site.run(cmd, host, timeout=60)
            assert r.returncode == 0, f"step {cmd.step} on mac{host}:\n{r.stdout}{r.stderr}"
            out.append(r.stdout)
    return out


def serve_command(site: Site) -> list[str]:
    cmd = next(c for c in checklist() if SERVE in c.text)
    assert cmd.hosts == (1,), "README serves from Mac 1"
    return shlex.split(site.on_rig(cmd.text, 1))


class Served:
    """The serve step on mac1, as written (and ``serve_args`` after it); output in ``log``."""

    def __init__(self, rig: rigmod.Rig, site: Site, *serve_args: str) -> None:
        self.rig, self.site = rig, site
        self.log_path = site.work / f"run-{time.monotonic_ns()}.log"
        self.t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*rig.netns(1), *serve_command(site), *serve_args],
                cwd=REPO,
                env=site.env(1),
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
    """A chat completion and a Messages request from mac``host``: tests/scripts/rig_client.py."""
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


def check_health(outputs: list[str]) -> None:
    """README's health step: ``/health`` without the key, ``/v1/models`` with it."""
    health, models = outputs
    assert json.loads(health) == {"status": "ok"}, health
    assert [m["id"] for m in json.loads(models)["data"]] == [TB5["model_id"]], models


def walkthrough(rig: rigmod.Rig, build: Path, work: Path) -> dict:
    """The checklist, a request from each Mac, then SIGTERM; returns what was measured."""
    site = make_site(rig, build, work, pipeline_to_end=True)
    served = Served(rig, site)
    result: dict = {}
    try:
        result["ready_s"] = round(served.wait_ready(), 1)
        check_health(after_serve(site))
        key_file = rig.home(1) / ".k3dist-key"
        result["from_mac1"] = client(rig, 1, key_file)
        result["from_mac2"] = client(rig, 2, key_file)
    finally:
        t0 = time.monotonic()
        served.stop()
        result["stop_s"] = round(time.monotonic() - t0, 1)
    result["exit_code"] = served.proc.returncode
    out = served.output()
    result["launch_files_left"] = launch_files_left(out)
    result["steps"] = site.log
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
