"""Two Macs, emulated for real (issue 39): two network namespaces with a real sshd each, joined
by a veth cable (tests/rig.py), and README's two-Mac checklist on them, its commands read
from README.md's table and run as written with the rig's names and paths (tests/two_macs.py
says what is substituted and which commands cannot run on Linux): ssh to both hosts, the
audit of the download (the shipped mini), the pipeline's plan for it (stopped after its plan
here), rank 1's folder rsynced over the cable, the key made on mac1 only, k3dist-doctor, the
supervised launch through mlx.launch's real ``ssh -tt`` path, the health checks with the
key; then the OpenAI and Anthropic clients from both hosts. Then the cable is pulled
mid-stream: the stream gets an error event, the supervisor exits 3 naming mac2 within the
watchdog's timeout + a few seconds, and a restart after the cable returns serves again.

The deployment turns warm-up off to keep the suite's budget (warm-up's 40 s of JIT
compiles on a loaded 2-core machine changes nothing on this path; `python
tests/two_macs.py` runs the checklist with it).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import rig as rigmod
import two_macs
from two_macs import PY, REPO, Served

WATCHDOG_TIMEOUT_S = two_macs.RIG_KEYS["watchdog_timeout_s"]


@pytest.fixture(scope="module")
def rig():
    why = rigmod.tools_missing()
    if why:
        pytest.fail(f"the two-host rig cannot be made here: {why} (.ci/run installs it)")
    r = rigmod.Rig.up()
    try:
        yield r
    finally:
        r.down()


@pytest.fixture(scope="module")
def site(rig):
    """README's checklist up to its serve step (its rank folders: the shipped mini's)."""
    from k3dist.pipeline import default

    s = two_macs.make_site(rig, default.ensure_default_build(), rig.root / "work", warmup=False)
    print("\n" + "\n".join(json.dumps(x) for x in s.log))
    return s


def _stream_on_mac1(rig, max_tokens: int) -> subprocess.Popen:
    return subprocess.Popen(
        [
            *rig.netns(1),
            PY,
            str(REPO / "tests/scripts/rig_client.py"),
            f"http://{rigmod.ADDRS[0]}:{two_macs.API_PORT}",
            str(rig.home(1) / ".k3dist-key"),
            "--stream",
            str(max_tokens),
            "--timeout-s",
            "60",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=rig.env(),
    )


def test_two_macs_walkthrough_then_cable_pulled_mid_stream(rig, site):
    key = rig.home(1) / ".k3dist-key"
    assert not (rig.home(2) / ".k3dist-key").exists()  # the key is on mac1 only
    served = Served(rig, site)
    stream = None
    try:
        ready = served.wait_ready(180)
        two_macs.check_health(two_macs.after_serve(site))
        # mlx.launch near 0 CPU over ssh (it spun a core selecting on its ssh clients'
        # stdin pipes), measured while the clients run: it only relays log lines
        launcher = served.launcher_pid()
        assert launcher is not None
        c0, t0 = two_macs.cpu_s(launcher), time.monotonic()
        for host in (1, 2):
            got = two_macs.client(rig, host, key)
            assert got["health"] == 200 and got["no_key"] == 401, got
            assert got["chat"]["completion_tokens"] > 0, got
            assert got["messages"]["output_tokens"] > 0, got
        idle, span = two_macs.cpu_s(launcher) - c0, time.monotonic() - t0
        assert idle < 0.1 * span, f"mlx.launch used {idle:.2f} CPU-s in {span:.1f} s"

        # the cable pulled while a stream decodes
        stream = _stream_on_mac1(rig, 3000)
        assert stream.stdout.readline().strip() == "SENT"
        assert stream.stdout.readline().strip() == "FIRST"
        t0 = time.monotonic()
        rig.cable(False)
        rc = served.wait_exit(WATCHDOG_TIMEOUT_S + 25)
        exit_s = time.monotonic() - t0
        out = served.output()
        got = json.loads(stream.communicate(timeout=30)[0].strip().splitlines()[-1])
    finally:
        rig.cable(True)
        served.stop()
        if stream is not None and stream.poll() is None:
            stream.kill()
    assert rc == 3, out
    assert "lost rank 1 on host k3h-mac2" in out, out
    left = two_macs.launch_files_left(out)  # rank 1's, behind the pulled cable
    assert "could not clean up on k3h-mac2" in out and left, out
    assert got["end"] == "error event", got
    assert "rank 1 was lost" in json.dumps(got["error"]), got
    bound = WATCHDOG_TIMEOUT_S + 10
    assert exit_s < bound, f"exit {exit_s:.1f} s after the pull (bound {bound} s):\n{out}"
    print(
        f"\nready in {ready:.1f} s; mlx.launch {idle:.2f} CPU-s in {span:.1f} s; cable pulled: "
        f"exit 3 after {exit_s:.1f} s"
    )

    # the cable back: a restart serves again, from mac2 too, and stops cleanly
    rig.wait_ssh()
    again = Served(rig, site)
    try:
        again.wait_ready(180)
        got = two_macs.client(rig, 2, key)
        assert got["chat"]["completion_tokens"] > 0, got
    finally:
        again.stop()
    out = again.output()
    assert again.proc.returncode == 0, out
    assert "temp file(s) an earlier run left on k3h-mac2" in out, out
    assert [f for f in left if os.path.exists(f)] == [], left
    assert two_macs.launch_files_left(out) == [], out
    left = [p for p in two_macs.rig_pids(2) if not two_macs.is_sshd(p)]
    assert left == [], left


def _doctor(rig, site, *args: str, config=None) -> tuple[int, str]:
    r = rig.on(
        1,
        [
            PY,
            "-m",
            "k3dist.serve.doctor",
            "--hostfile",
            str(site.hostfile),
            "--config",
            str(config or site.deploy),
            *args,
        ],
        cwd=REPO,
        timeout=120,
    )
    return r.returncode, r.stdout + r.stderr


def _line(out: str, host: str, check: str) -> str:
    hits = [x for x in out.splitlines() if x.startswith("[") and f"] {host}: {check}" in x]
    assert len(hits) == 1, (host, check, out)
    return hits[0]


def test_doctor_catches_each_misconfiguration_on_the_rig(rig, site, tmp_path):
    """k3dist-doctor on the rig (clean in README's checklist: the site fixture), each
    Linux-visible misconfiguration made for real (several at once, each its own line;
    mac2's clock moved for what its ssh sessions run, as the namespaces share the
    kernel's), then mac2's sshd gone, then everything put back: the full doctor passes."""
    key = rig.home(1) / ".k3dist-key"
    shard = sorted(site.rank_folder(1).glob("*.safetensors"))[0]
    original = shard.read_bytes()
    fake = tmp_path / "site"
    (fake / "mlx_lm-0.31.0.dist-info").mkdir(parents=True)
    (fake / "mlx_lm-0.31.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: mlx-lm\nVersion: 0.31.0\n"
    )
    big = site.work / "deploy-big.yaml"
    tiny = tmp_path / "tiny"  # the prefix cache on a 1 MB disk
    tiny.mkdir()
    big.write_text(
        site.deploy.read_text()
        + f"memory_headroom_gib: 100000\nprefix_cache_dir: {json.dumps(str(tiny))}\n"
    )
    squatter = subprocess.Popen(
        [
            *rig.netns(2),
            PY,
            "-c",
            "import socket, sys, time; s = socket.socket(); "
            "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            f"s.bind(('{rigmod.ADDRS[1]}', {two_macs.RING_PORT + 1})); s.listen(); "
            "print('up', flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        rig.in_hosts(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(tiny)])
        assert squatter.stdout.readline().strip() == "up"
        key.rename(key.with_suffix(".gone"))  # the key file missing on rank 0's host
        shard.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # one bit flipped
        rig.block_ports(1, two_macs.RING_PORT)  # mac1's ring port behind a firewall
        # mac2's shell profile: another mlx-lm first on its path, an MLX_ variable; and
        # its clock 90 s ahead, as everything its ssh sessions run sees it (libfaketime)
        rig.set_env(
            2,
            {"PYTHONPATH": str(fake), "MLX_METAL_FAST_SYNCH": "1", **rigmod.skewed_clock(90)},
        )
        r = rig.on(1, ["ssh", rigmod.HOSTS[1], "date +%s"])
        assert 85 < int(r.stdout) - time.time() < 95, (r.stdout, r.stderr)
        rc, out = _doctor(rig, site, config=big)
        assert rc == 1, out
        # a warning (a launch works with a skewed clock; logs and caches disagree on times)
        line = _line(out, "k3h-mac2", "clock skew")
        assert line.startswith("[warn]") and "-- fix: ssh k3h-mac2 sudo sntp" in line, line
        assert 80 < float(line.split("clock skew: ")[1].split(" s")[0]) < 95, line
        assert _line(out, "k3h-mac1", "clock skew").startswith("[ok"), out
        print(f"\nmac2 90 s ahead: {line}")
        for host, check, says in (
            ("k3h-mac1", "API key (rank 0)", "missing"),
            ("k3h-mac2", "rank 1 folder", shard.name),
            ("k3h-mac2", f"port {rigmod.ADDRS[1]}:{two_macs.RING_PORT + 1}", "cannot bind"),
            ("k3h-mac2", f"reaches {rigmod.ADDRS[0]}:{two_macs.RING_PORT}", ""),
            ("k3h-mac2", "mlx-lm version", "0.31.0"),
            ("k3h-mac2", "MLX_*/JACCL_* environment", "MLX_METAL_FAST_SYNCH"),
            ("k3h-mac1", "free memory", "the plan needs"),
        ):
            line = _line(out, host, check)
            assert line.startswith("[FAIL]") and says in line and "-- fix: " in line, line
        assert _line(out, "k3h-mac1", "mlx-lm version").startswith("[ok")
        for host in rigmod.HOSTS:  # a warning: serving works, the prefix cache cannot grow
            line = _line(out, host, "free disk")
            assert line.startswith("[warn]") and f"free at {tiny}" in line, line
        # launch/run.py runs the fast subset first: nothing starts
        served = Served(rig, site)
        assert served.wait_exit(60) == 2, served.output()
        assert "k3dist-doctor --fast" in served.output(), served.output()
        assert "API key (rank 0)" in served.output(), served.output()
    finally:
        rig.in_hosts(["umount", "-l", str(tiny)], check=False)
        squatter.kill()
        if key.with_suffix(".gone").exists():
            key.with_suffix(".gone").rename(key)
        shard.write_bytes(original)
        rig.block_ports(1, None)
        rig.set_env(2, {})

    rig.stop_sshd(2)
    try:
        rc, out = _doctor(rig, site, "--fast")
        assert rc == 1, out
        line = _line(out, "k3h-mac2", "ssh")
        assert line.startswith("[FAIL]") and "refused" in line and "Remote Login" in line, line
    finally:
        rig.start_sshd(2)
        rig.wait_ssh()
    rc, out = _doctor(rig, site)  # everything put back: the full doctor passes
    assert rc == 0, out
    for host in rigmod.HOSTS:
        assert _line(out, host, "clock skew").startswith("[ok"), out


# rank 0 ends with code 1 after 4 s, rank 1 would sleep a minute: mlx.launch then kills
# rank 1 with its own remote kill (the pid file it read back from the rank's ssh -tt)
_PLAIN_RANKS = (
    "import os, time; r = int(os.environ['MLX_RANK']); print('up', r, os.getpid(), flush=True); "
    "time.sleep(4 if r == 0 else 60); raise SystemExit(1)"
)


def test_plain_mlx_launch_over_ssh_with_the_ssh_shim_on_its_path(rig):
    """docs/two-hosts.md's way for a plain ``mlx.launch`` started by hand over ssh: k3dist's
    ssh shim first on its PATH and Enter pressed once after the ranks started. mlx.launch
    then sleeps instead of spinning a core per rank, and its own remote kill finds the
    rank's pid file (no ``\\r``) and removes it."""
    from k3dist.serve import supervise

    env = rig.env()
    env["PATH"] = f"{supervise.SSH_SHIM_DIR}:{env['PATH']}"
    t_start = time.time() - 1
    launch = [str(REPO / ".venv/bin/mlx.launch"), "--hostfile", str(rig.hostfile)]
    p = subprocess.Popen(
        [*rig.netns(1), *launch, "--python", PY, "-p", str(two_macs.RING_PORT)]
        + ["--", "-c", _PLAIN_RANKS],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,  # as a terminal: /dev/null is always readable, a spin of its own
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        pids, lines = {}, []
        deadline = time.monotonic() + 30
        while len(pids) < 2 and time.monotonic() < deadline:
            line = p.stdout.readline()
            lines.append(line)
            if line.startswith("up "):
                _, rank, pid = line.split()
                pids[int(rank)] = pid
            assert line, "".join(lines)
        assert len(pids) == 2, "".join(lines)
        # one line typed (Enter): mlx.launch forwards it to each rank's ssh, whose stdin
        # the shim closed, meets the broken pipe and stops selecting on it (else it spins)
        p.stdin.write("\n")
        p.stdin.flush()
        time.sleep(0.5)
        c0 = two_macs.cpu_s(p.pid)
        time.sleep(2.0)
        idle = two_macs.cpu_s(p.pid) - c0
        out = p.communicate(timeout=30)[0]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait(10)
    assert idle < 0.3, f"mlx.launch used {idle:.2f} CPU-s in 2 s over ssh"
    assert "Node with rank 0 exited with code 1" in out, out
    assert "Node with rank 1 was killed" in out, out  # its remote kill worked
    assert "Traceback" not in out, out  # no CalledProcessError from the kill's rm
    # the killed rank's pid file removed by that kill; rank 0's, which ended by itself, and
    # both ring hostfiles stay (bug 2: launch/run.py removes them; this test does here)
    ours = [f for f in _new_tmp_files(t_start) if _holds(f, [*pids.values(), RING_HOSTFILE])]
    for f in ours:
        f.unlink()
    assert not [f for f in ours if _holds(f, [pids[1]])], ours
    assert [q for q in two_macs.rig_pids(2) if not two_macs.is_sshd(q)] == []


RING_HOSTFILE = json.dumps([[f"{a}:{two_macs.RING_PORT + i}"] for i, a in enumerate(rigmod.ADDRS)])


def _new_tmp_files(since: float) -> list[Path]:
    out = []
    for f in Path("/tmp").glob("tmp.*"):
        try:
            if f.is_file() and f.stat().st_mtime >= since:
                out.append(f)
        except OSError:
            continue
    return out


def _holds(f: Path, pids) -> bool:
    try:
        return f.read_text().strip() in pids
    except (OSError, UnicodeDecodeError):
        return False


# ---------------------------------------------------------------- no rig needed


def test_supervisor_names_the_lost_peer_not_the_survivor():
    from k3dist.serve import supervise

    state = supervise._State()
    state.scan("[k3dist watchdog rank 0] lost rank 1 (silent for 5.0 s); exiting with code 3: x\n")
    state.scan("\x1b[33m[WARN] Node with rank 0 exited with code 3\x1b[0m\n")
    assert state.lost_peer() == (1, 0, "silent for 5.0 s")
    state.scan("[WARN] Node with rank 1 exited with code 1\n")  # rank 1's own report came
    assert state.lost_peer() is None and state.cause() == (1, 1)


def test_launch_files_are_found_beside_the_ring_hostfile(tmp_path, monkeypatch):
    from k3dist.serve import supervise

    hostfile = tmp_path / "tmp.AbC123"
    hostfile.write_text('[["10.77.0.1:22100"], ["10.77.0.2:22101"]]\n')
    pidfile = tmp_path / "tmp.XyZ789"
    pidfile.write_text(f"{os.getpid()}\n")
    (tmp_path / "tmp.Other1").write_text("1\n")  # another rank's pid file
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    assert supervise.launch_files() == [str(hostfile), str(pidfile)]
    monkeypatch.setenv("MLX_HOSTFILE", str(tmp_path / "my-hostfile.json"))  # the user's own
    assert supervise.launch_files() == []


def test_ssh_shim_detaches_stdin_and_keeps_the_pid_path_clean(tmp_path):
    """The shim (first on mlx.launch's PATH) runs the next ssh on PATH: a rank's
    ``ssh -tt`` with stdin from /dev/null and ``stty -onlcr``; other calls with a connect
    timeout."""
    from k3dist.serve import supervise

    fake = tmp_path / "ssh"
    fake.write_text('#!/bin/sh\nprintf "%s|" "$@"; readlink /proc/self/fd/0\n')
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{supervise.SSH_SHIM_DIR}:{tmp_path}:{os.environ['PATH']}")
    shim = os.path.join(supervise.SSH_SHIM_DIR, "ssh")
    r = subprocess.run(
        ["bash", "-c", f"{shim} -tt -o LogLevel=QUIET mac2 'stty -echo; pidfile=$(mktemp)'"],
        env=env,
        input="x",
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.stdout == (
        "-tt|-o|LogLevel=QUIET|mac2|stty -echo -onlcr 2>/dev/null; pidfile=$(mktemp)|/dev/null\n"
    ), r
    r = subprocess.run(
        ["bash", "-c", f"{shim} mac2 'kill 1'"], env=env, capture_output=True, text=True
    )
    assert r.stdout.startswith("-o|ConnectTimeout=5|mac2|kill 1|"), r


def test_cable_fault_table_in_docs_matches_its_results_file():
    """docs/two-hosts.md's table is benchmarks/faults/cable_faults.py's rendering of its JSON."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "cable_faults", REPO / "benchmarks" / "faults" / "cable_faults.py"
    )
    cable_faults = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cable_faults)
    result = json.loads((REPO / "benchmarks/results/2026-12-06/cable-faults.json").read_text())
    assert cable_faults.table(result) in (REPO / "docs/two-hosts.md").read_text()
