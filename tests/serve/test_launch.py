"""launch/run.py: mlx.launch supervised (issue 10 items 5, 6, 7 and the handshake of 9).

Real processes throughout: the wrapper as a subprocess, a real mlx.launch with real
ranks on loopback (tests/scripts/watchdog_peer.py: a watchdog and an all_sum loop;
launch/serve.py and launch/generate.py on real rank folders), real signals, a real
ssh client against hosts that cannot answer.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from k3dist.pipeline import slicing
from k3dist.serve import supervise

import pytest
from util import REPO, free_base_port, launch_cmd, wait_file

RUN = REPO / "launch" / "run.py"
PEER = REPO / "tests" / "scripts" / "watchdog_peer.py"
# watchdog_peer.py's watchdog: silent after 3 s; a silent same-host peer gets
# SIGTERM, then SIGKILL 2 s later (stop_grace_s).
PEER_TIMEOUT_S, PEER_GRACE_S = 3.0, 2.0


def _wrapper(*opts: str, script: Path, args: tuple[str, ...] = ()) -> list[str]:
    """launch/run.py with ``opts``, running ``script`` with ``args`` on every rank."""
    return [sys.executable, str(RUN), *opts, "--", str(script), *args]


def _two_ranks(script: Path, *args: str) -> list[str]:
    """launch/run.py running ``script`` with ``args`` on 2 ranks over loopback, free ports."""
    return _wrapper("-n", "2", "-p", str(free_base_port(2)), script=script, args=args)


def _peer_cmd(
    tmp: Path, *opts: str, peer_args: tuple[str, ...] = (), where: tuple[str, ...] = ("-n", "2")
) -> list[str]:
    return _wrapper(
        *where,
        "-p",
        str(free_base_port(2)),
        *opts,
        script=PEER,
        args=("--launch", "--pid-dir", str(tmp), *peer_args),
    )


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # an unreaped orphan has exited too


class Launch:
    """The wrapper running watchdog_peer.py on two ranks; output in a file."""

    def __init__(
        self,
        tmp: Path,
        *opts: str,
        peer_args: tuple[str, ...] = (),
        plain: bool = False,
        where: tuple[str, ...] = ("-n", "2"),
        env: dict | None = None,
    ):
        self.tmp, self.log_path = tmp, tmp / "run.log"
        self.log = open(self.log_path, "w")
        if plain:  # plain mlx.launch, for comparison
            cmd = launch_cmd(2, PEER, "--launch", "--pid-dir", str(tmp), *peer_args)
        else:
            cmd = _peer_cmd(tmp, *opts, peer_args=peer_args, where=where)
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
            start_new_session=True,
        )
        self.pids = [int(wait_file(tmp / f"rank{r}.pid", self.proc)) for r in range(2)]
        self.launchers = self._launcher_pids()
        assert len(self.launchers) == 1, self.launchers
        time.sleep(1.0)  # both ranks in their all_sum loop

    def _launcher_pids(self) -> list[int]:
        """mlx.launch processes of this run (the wrapper's child, or the plain launcher)."""
        out = []
        for pid in os.listdir("/proc"):
            if pid.isdigit() and _alive(int(pid)):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if b"mlx.launch" in cmd and str(self.tmp).encode() in cmd:
                    out.append(int(pid))
        return out

    def wait_all_gone(self, t0: float, bound_s: float) -> float:
        """Seconds from t0 until the wrapper, mlx.launch and both ranks are gone."""
        launchers = self.launchers
        deadline = t0 + bound_s
        while time.monotonic() < deadline:
            if (
                self.proc.poll() is not None
                and not any(map(_alive, self.pids))
                and not any(map(_alive, launchers))
            ):
                return time.monotonic() - t0
            time.sleep(0.05)
        left = [p for p in (*self.pids, *launchers) if _alive(p)]
        raise AssertionError(
            f"still running {bound_s} s later: {left} (wrapper {self.proc.poll()})\n{self.output()}"
        )

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in self.pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.log.close()


# ---------------------------------------------------------------- item 6: unreachable host


@pytest.fixture
def silent_ssh_host():
    """127.0.0.3 port 22 accepting connections that never speak: ssh waits for the
    banner forever (the hang of issue 10 item 6), with no network involved."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.3", 22))
    except OSError as e:
        s.close()
        pytest.skip(f"cannot listen on 127.0.0.3:22 here ({e}); the other hosts still run")
    s.listen(16)
    yield "127.0.0.3"
    s.close()


def _unreachable(tmp_path: Path, host: str, timeout_s: float = 2.0):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(
        json.dumps(
            [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}, {"ssh": host, "ips": ["10.255.255.1"]}]
        )
    )
    cmd = _wrapper(
        "--hostfile",
        str(hostfile),
        "--host-timeout-s",
        str(timeout_s),
        script=PEER,
        args=("--launch", "--pid-dir", str(tmp_path)),
    )
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    return res, time.monotonic() - t0


def test_silent_host_fails_within_its_timeout(tmp_path, silent_ssh_host):
    # Without the bound, ssh would wait here forever.
    plain = subprocess.Popen(
        ["ssh", "-o", "BatchMode=yes", silent_ssh_host, "true"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    res, dt = _unreachable(tmp_path, silent_ssh_host, timeout_s=2.0)
    still_waiting = plain.poll() is None
    plain.kill()
    plain.wait()
    assert still_waiting, "plain ssh to the silent host ended on its own"
    assert res.returncode == supervise.START_FAILED_EXIT_CODE, res.stderr
    msg = res.stderr
    assert f"host {silent_ssh_host} (rank 1 in " in msg and "fix:" in msg, msg
    assert "timed out" in msg and "no rank was started" in msg, msg
    checked = float(re.search(r"checked in ([\d.]+) s", msg)[1])
    assert 1.5 <= checked <= 2.0 + 1.0, checked  # ssh's ConnectTimeout=2 is the bound
    assert not list(tmp_path.glob("rank*.p*")), "a rank was started"
    print(f"\nsilent host: refused after {checked:.1f} s of probing ({dt:.1f} s in all)")


@pytest.mark.parametrize(
    "host,expect",
    [
        ("127.0.0.2", "Remote Login"),  # nothing listens on port 22: refused at once
        ("k3dist-no-such-host.invalid", "correct the `ssh` name"),  # never resolves (RFC 2606)
    ],
)
def test_unreachable_host_fails_fast_with_its_name(tmp_path, host, expect):
    res, dt = _unreachable(tmp_path, host, timeout_s=2.0)
    assert res.returncode == supervise.START_FAILED_EXIT_CODE, res.stderr
    assert f"host {host} (rank 1 in " in res.stderr and expect in res.stderr, res.stderr
    checked = float(re.search(r"checked in ([\d.]+) s", res.stderr)[1])
    assert checked <= 2.0 + 5.0  # the probe's hard bound
    assert not list(tmp_path.glob("rank*.p*")), "a rank was started"
    print(f"\n{host}: refused after {checked:.1f} s of probing ({dt:.1f} s in all)")


# ---------------------------------------------------------------- item 7: exit codes


def test_clean_stop_exits_zero(tmp_path):
    run = Launch(tmp_path)
    try:
        t0 = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)  # what a supervisor sends
        dt = run.wait_all_gone(t0, 15.0)
        out = run.output()
        assert run.proc.returncode == 0, out
        for r in range(2):
            assert f"[k3dist watchdog rank {r}] stopping: SIGTERM" in out, out
        print(f"\nSIGTERM to the wrapper: everything gone, exit 0, after {dt:.2f} s")
    finally:
        run.close()


def test_killed_rank_exit_code(tmp_path):
    """Plain mlx.launch exits 0 here; the wrapper reports the killed rank (128 + 9)."""
    run = Launch(tmp_path)
    try:
        t0 = time.monotonic()
        os.kill(run.pids[1], signal.SIGKILL)
        dt = run.wait_all_gone(t0, 15.0)
        out = run.output()
        assert run.proc.returncode == 128 + signal.SIGKILL, out
        assert "rank 1 failed (it exited with -9" in out, out
        print(f"\nSIGKILL rank 1: wrapper exit {run.proc.returncode} after {dt:.2f} s")
    finally:
        run.close()


# ---------------------------------------------------------------- item 5: a frozen rank


@pytest.mark.parametrize("victim", [1, 0])
def test_frozen_rank_is_ended_by_its_peer(tmp_path, victim):
    """SIGSTOP one rank: the other declares it lost after the watchdog timeout, ends it
    (same machine: SIGTERM + SIGCONT, SIGKILL after the grace) and exits; mlx.launch
    then ends too."""
    run = Launch(tmp_path)
    try:
        t0 = time.monotonic()
        os.kill(run.pids[victim], signal.SIGSTOP)
        dt = run.wait_all_gone(t0, PEER_TIMEOUT_S + PEER_GRACE_S + 10.0)
        out = run.output()
        assert f"lost rank {victim} (silent for" in out, out
        # Resumed by the SIGCONT, the victim sees the group gone and exits by itself.
        assert f"[k3dist watchdog rank {victim}] this rank did not run for" in out, out
        assert "sent SIGKILL" not in out, out
        assert run.proc.returncode == 3, out  # each exited 3: a peer was lost
        print(
            f"\nSIGSTOP rank {victim}: everything gone after {dt:.2f} s "
            f"(timeout {PEER_TIMEOUT_S:g} s + grace {PEER_GRACE_S:g} s), "
            f"exit {run.proc.returncode}"
        )
    finally:
        run.close()


def test_frozen_rank_under_plain_mlx_launch_is_ended_too(tmp_path):
    """README command 1 (plain mlx.launch) on one machine: before, mlx.launch and the
    frozen rank stayed forever (issue 10 item 5). Its exit code still says 0."""
    run = Launch(tmp_path, plain=True)
    try:
        t0 = time.monotonic()
        os.kill(run.pids[1], signal.SIGSTOP)
        dt = run.wait_all_gone(t0, PEER_TIMEOUT_S + PEER_GRACE_S + 10.0)
        assert "lost rank 1 (silent for" in run.output()
        print(f"\nplain mlx.launch, SIGSTOP rank 1: everything gone after {dt:.2f} s")
    finally:
        run.close()


GRACE_S = 1.0  # the wrapper's --grace-s and --kill-grace-s where rank 1 is out of reach


def _out_of_reach(tmp: Path, **kw) -> Launch:
    """Rank 1 out of its peer's reach (``--no-kill-silent``: as on another Mac), the
    wrapper's grace and kill grace GRACE_S."""
    return Launch(
        tmp,
        "--grace-s",
        str(GRACE_S),
        "--kill-grace-s",
        str(GRACE_S),
        peer_args=("--no-kill-silent",),
        **kw,
    )


def test_frozen_rank_out_of_reach_is_ended_by_the_wrapper(tmp_path):
    """The peer cannot signal it (as for a rank on another Mac): mlx.launch hangs on
    the frozen rank after rank 0 exits; the wrapper ends the group after --grace-s."""
    grace = GRACE_S
    run = _out_of_reach(tmp_path)
    try:
        t0 = time.monotonic()
        os.kill(run.pids[1], signal.SIGSTOP)
        dt = run.wait_all_gone(t0, PEER_TIMEOUT_S + 2 * grace + 10.0)
        out = run.output()
        assert "mlx.launch did not end within" in out, out
        assert run.proc.returncode == 3, out  # rank 0's "lost a peer"; rank 1 never reported
        print(
            f"\nSIGSTOP rank 1, out of its peer's reach: everything gone after {dt:.2f} s "
            f"(timeout {PEER_TIMEOUT_S:g} s + grace {grace:g} s + kill grace {grace:g} s)"
        )
    finally:
        run.close()


def test_frozen_rank_on_another_machine_is_ended_over_ssh(tmp_path):
    """Two Macs, emulated: rank 1's host is reached through tests/scripts/fake_ssh/ssh
    (first on PATH), which runs the command here in its own session so that, as over
    real ssh, killing the client leaves the "remote" rank running. The watchdog sees
    rank 1 as local (loopback), so --no-kill-silent stands in for another machine.
    mlx.launch's own teardown (through k3dist's ssh shim, then the fake ssh) may or may
    not end the frozen rank's client within the grace; either way the wrapper ends the
    rank over ssh. A real sshd and its pty hangup: tests/serve/test_two_hosts.py."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(
        json.dumps(
            [
                {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]},
                {"ssh": "fake-mac-2", "ips": ["127.0.0.1"]},
            ]
        )
    )
    env = dict(os.environ, PATH=f"{REPO / 'tests/scripts/fake_ssh'}:{os.environ['PATH']}")
    grace = GRACE_S
    run = _out_of_reach(tmp_path, where=("--hostfile", str(hostfile)), env=env)
    try:
        t0 = time.monotonic()
        os.kill(run.pids[1], signal.SIGSTOP)
        dt = run.wait_all_gone(t0, PEER_TIMEOUT_S + 3 * grace + 10.0)
        out = run.output()
        assert (
            f"rank 1 (pid {run.pids[1]} on fake-mac-2) was not reported ended: ending it "
            "over ssh" in out
        ), out
        assert run.proc.returncode == 3, out
        print(f"\nSIGSTOP rank 1 on a (fake) remote host: everything gone after {dt:.2f} s")
    finally:
        run.close()


def test_end_remote_rank_command_ends_stopped_and_stubborn_processes():
    """The script the wrapper runs over ssh on another machine, run here under sh: a
    stopped process ends on SIGTERM + SIGCONT, one that ignores SIGTERM on SIGKILL."""
    stubborn_code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    stubborn_code += "print(flush=True); time.sleep(60)"
    stopped = subprocess.Popen(["sleep", "60"])
    os.kill(stopped.pid, signal.SIGSTOP)
    stubborn = subprocess.Popen([sys.executable, "-c", stubborn_code], stdout=subprocess.PIPE)
    stubborn.stdout.readline()  # its handler is in place
    grace = 1.0
    try:
        for p, sig, lo, hi in (
            (stopped, signal.SIGTERM, 0.0, grace),
            (stubborn, signal.SIGKILL, grace, grace + 2.0),
        ):
            script = supervise.end_remote_rank_command("mac-2", p.pid, kill_grace_s=grace)
            assert script[:2] == ["ssh", "-o"] and "mac-2" in script
            reaper = threading.Thread(target=p.wait)  # as the rank's parent would
            reaper.start()
            t0 = time.monotonic()
            subprocess.run(["sh", "-c", script[-1]], check=True, timeout=10)
            reaper.join(5)
            assert p.returncode == -sig and lo <= time.monotonic() - t0 < hi
    finally:
        for p in (stopped, stubborn):
            if p.poll() is None:
                p.kill()


# ---------------------------------------------------------------- start-up failures (7, 9)


@pytest.fixture(scope="module")
def broken_ranks(mini_build, tmp_path_factory):
    """Rank folders whose rank 1 has a truncated shard."""
    out = tmp_path_factory.mktemp("broken-ranks")
    for r in range(2):
        slicing.slice_rank(mini_build, out / f"rank{r}", r, 2, None, progress=False)
    shard = max((out / "rank1").glob("model-layer-*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 4096)
    return str(out / "rank{rank}")


def test_startup_failure_exits_nonzero_with_the_reason(broken_ranks, tmp_path):
    """serve.py: rank 1 refuses its folder; its watchdog sends the reason, rank 0 names
    it and exits; the wrapper exits with rank 1's code (plain mlx.launch: 0)."""
    env = dict(os.environ, HOME=str(tmp_path))  # no Hugging Face cache
    cmd = _two_ranks(
        REPO / "launch" / "serve.py",
        "--rank-dir",
        broken_ranks,
        "--no-warmup",
        "--port",
        str(free_base_port(1)),
    )
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "[k3dist watchdog rank 1] failed: CheckpointError:" in out, out
    assert (
        "lost rank 1 (failed: CheckpointError:" in out
        or "rank 1 failed during start-up: CheckpointError:" in out
    ), out
    assert "the file is truncated" in out or "folder is damaged" in out, out


def test_handshake_names_a_rank_that_failed(broken_ranks, tmp_path):
    """generate.py (no watchdog): rank 0 reaches the handshake after rank 1 has gone;
    it used to die of an IndexError on the garbage the ring returned."""
    cmd = _two_ranks(
        REPO / "launch" / "generate.py", "--rank-dir", broken_ranks, "--max-tokens", "2"
    )
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "IndexError" not in out, out
    assert "PeerFailed: rank 1 failed during start-up" in out, out


def test_reads_interleaved_launcher_reports():
    """mlx.launch prints from one thread per rank; lines seen here mixed two reports
    (2026-12-01). Every report counts; a rank's 3 (lost a peer) gives way to the cause."""
    state = supervise._State()
    state.scan(
        "[k3dist watchdog rank 1] 2 rank(s) joined via 10.10.0.1:33323 (heartbeat 1 s, "
        "lost after 10 s of silence; pid 4242)\r\n"
    )
    state.scan(
        "\x1b[33m[WARN]\x1b[33m[WARN] Node with rank 0 exited with code 3 \x1b[0m "
        "Node with rank 1 exited with code -9 \x1b[0m\n"
    )
    state.scan("\x1b[33m[WARN] Node with rank 2 was killed \x1b[0m\n")
    assert state.pids == {1: 4242} and state.failures == [(0, 3), (1, -9)]
    assert state.ended == {0, 1}  # "was killed" is only a SIGTERM sent, not an end seen
    assert state.cause() == (1, -9) and supervise.exit_code(-9) == 137


def test_wrapper_passes_output_and_arguments(tmp_path):
    """Options it does not know go to mlx.launch; the script's own after --."""
    script = tmp_path / "hello.py"
    script.write_text(
        "import os, sys\nprint('rank', os.environ['MLX_RANK'], sys.argv[1:],"
        " os.environ.get('K3_TEST'))\n"
    )
    res = subprocess.run(
        _wrapper("-n", "2", "--env", "K3_TEST=yes", script=script, args=("--flag", "x")),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    for r in range(2):
        assert f"rank {r} ['--flag', 'x'] yes" in res.stdout, res.stdout
    bad = subprocess.run(
        [sys.executable, str(RUN), "-n", "2", str(script)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert bad.returncode == 2 and "after --" in bad.stderr


# ---------------------------------------------------------------- the server, mid-stream


@pytest.fixture(scope="module")
def good_ranks(mini_build, tmp_path_factory):
    out = tmp_path_factory.mktemp("good-ranks")
    for r in range(2):
        slicing.slice_rank(mini_build, out / f"rank{r}", r, 2, None, progress=False)
    return str(out / "rank{rank}")


def test_frozen_rank_mid_stream_ends_the_deployment(good_ranks, tmp_path):
    """Issue 10 item 5 as reported: SIGSTOP rank 1 of the server mid-stream. The client
    gets the error, then every process (wrapper, mlx.launch, both ranks) is gone; the
    wrapper exits 3 (rank 0 lost rank 1; rank 1, resumed, lost rank 0)."""
    openai = pytest.importorskip("openai")
    port = free_base_port(1)
    env = dict(os.environ, HOME=str(tmp_path))  # no Hugging Face cache
    log_path = tmp_path / "serve.log"
    timeout_s = 3.0
    # paused in the 20th decode step (60 s at most), so the SIGSTOP finds the request
    # generating (tests/serve/test_server_faults.py's PAUSED says why)
    cmd = _two_ranks(
        REPO / "tests" / "scripts" / "serve_paused.py",
        "--pause-after",
        "20",
        "--pause-s",
        "60",
        "--rank-dir",
        good_ranks,
        "--no-warmup",
        "--port",
        str(port),
        "--watchdog-timeout-s",
        str(timeout_s),
    )
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
        )
    pids: dict[int, int] = {}
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60
        )
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                time.sleep(0.5)
        for m in re.finditer(
            r"\[k3dist watchdog rank (\d)\] .*; pid (\d+)\)", log_path.read_text()
        ):
            pids[int(m[1])] = int(m[2])
        assert set(pids) == {0, 1}, log_path.read_text()
        stream = client.completions.create(
            model="kimi-k3", prompt="def f(x):", max_tokens=400, temperature=0.0, stream=True
        )
        got, error, t0 = 0, None, None
        try:
            for _ in stream:
                got += 1
                if got == 3:
                    os.kill(pids[1], signal.SIGSTOP)
                    t0 = time.monotonic()
        except Exception as e:  # noqa: BLE001 - the client must see an error, not hang
            error = e
        t_error = time.monotonic() - t0
        assert error is not None and "rank 1 was lost (silent for" in str(error), (got, error)
        launchers = [
            int(p)
            for p in os.listdir("/proc")
            if p.isdigit()
            and _alive(int(p))
            and b"mlx.launch" in Path(f"/proc/{p}/cmdline").read_bytes()
            and str(port).encode() in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        bound = timeout_s + 2.0 + 10.0
        while time.monotonic() - t0 < bound:
            if proc.poll() is not None and not any(map(_alive, [*pids.values(), *launchers])):
                break
            time.sleep(0.05)
        t_gone = time.monotonic() - t0
        out = log_path.read_text()
        assert proc.poll() == 3, out
        assert not any(map(_alive, [*pids.values(), *launchers])), out
        print(
            f"\nserver, SIGSTOP rank 1 mid-stream (watchdog {timeout_s:g} s): client error "
            f"after {t_error:.1f} s, everything gone after {t_gone:.1f} s, exit "
            f"{proc.returncode}"
        )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
