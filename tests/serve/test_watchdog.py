"""Peer watchdog: threads, processes, mlx.launch.

Everything is real: loopback TCP, real processes killed with real signals, a real
ring group under mlx.launch. Timeouts are short so the file runs in well under 60 s.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from k3dist.serve import peer_link, watchdog
from k3dist.serve.peer_link import WatchdogError
from k3dist.serve.watchdog import Watchdog

import pytest
from util import REPO, failed_ranks, feed_stdin, launch_cmd, wait_file

PEER = REPO / "tests" / "scripts" / "watchdog_peer.py"
# The scripts' watchdog: heartbeat 0.2 s, silent after 3 s. A killed process closes
# its socket, which must be noticed well inside 2 s.
CLOSED_BOUND_S = 2.0


# ---------------------------------------------------------------- coordinator address


def test_coordinator_address(tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["10.0.0.1:5000", "10.0.1.1:5001"], ["10.0.0.2:5002"]]))
    env = {"MLX_HOSTFILE": str(hostfile)}
    assert peer_link.coordinator_address(environ=env) == ("10.0.0.1", 6000)
    assert peer_link.coordinator_address(environ=env, port=7000) == ("10.0.0.1", 7000)
    assert peer_link.coordinator_address(environ={"MLX_JACCL_COORDINATOR": "10.0.0.9:3000"}) == (
        "10.0.0.9",
        4000,
    )
    assert peer_link.coordinator_address(environ={}) == ("127.0.0.1", 32323 + 1000)
    hostfile.write_text("not json")
    with pytest.raises(WatchdogError, match="MLX_HOSTFILE"):
        peer_link.coordinator_address(environ=env)


# ---------------------------------------------------------------- watchdog in threads


def _group(n: int, **kw) -> tuple[list[Watchdog], list[int]]:
    """n watchdogs in this process; hard exits are recorded instead of taken."""
    codes: list[int] = []
    kw = {
        "interval_s": 0.1,
        "timeout_s": 1.0,
        "connect_timeout_s": 10.0,
        "hard_exit": codes.append,
    } | kw
    w0 = Watchdog(0, n, "127.0.0.1", 0, **kw)
    ws = [w0] + [Watchdog(r, n, "127.0.0.1", w0.port, **kw) for r in range(1, n)]
    threads = [threading.Thread(target=w.start) for w in ws]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return ws, codes


def _pair(**kw) -> tuple[Watchdog, Watchdog, list[int]]:
    (w0, w1), codes = _group(2, **kw)
    return w0, w1, codes


def _wait(cond, timeout_s: float) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"not within {timeout_s} s"
        time.sleep(0.01)
    return time.monotonic() - t0


def test_watchdog_threads_heartbeat_then_stop(capfd):
    stops = []
    w0, w1, codes = _pair(on_stop=lambda reason, origin: stops.append((reason, origin)))
    time.sleep(2.5)  # > 2x timeout_s: only the heartbeats keep both alive
    assert w0.exit_code is None and w1.exit_code is None, (w0.events, w1.events)
    w1.broadcast_stop("test over")
    dt = _wait(lambda: len(codes) == 2, 3.0)  # exit_code is set before the 0.2 s flush
    assert (w0.exit_code, w1.exit_code) == (0, 0) and codes == [0, 0]
    assert sorted(stops) == [("test over", 1)] * 2
    err = capfd.readouterr().err
    assert "[k3dist watchdog rank 0] stopping: test over (from rank 1)" in err
    assert "[k3dist watchdog rank 1] stopping: test over (from rank 1)" in err
    print(f"\nstop reached both ranks in {dt * 1000:.0f} ms")


def test_watchdog_silent_peer_is_lost_within_timeout():
    """A peer whose socket stays open but says nothing (a hung machine)."""
    codes: list[int] = []
    w0 = Watchdog(0, 2, "127.0.0.1", 0, interval_s=0.1, timeout_s=1.0, hard_exit=codes.append)
    t = threading.Thread(target=w0.start)
    t.start()
    sock = socket.create_connection(("127.0.0.1", w0.port), timeout=5)
    sock.sendall(b"HELLO 1 2\n")
    assert sock.recv(6) == b"READY\n"
    t0 = time.monotonic()  # rank 0 starts the silence clock just before READY
    t.join(5)
    _wait(lambda: w0.exit_code is not None, 3.0)
    dt = time.monotonic() - t0
    sock.close()
    assert w0.exit_code == watchdog.LOST_EXIT_CODE
    assert any(e.startswith("lost rank 1 (silent for") for e in w0.events), w0.events
    assert 0.9 <= dt < 1.5, dt
    print(f"\nsilent peer (timeout 1.0 s) lost after {dt:.2f} s")


@pytest.mark.parametrize("clean", [True, False])
def test_watchdog_close(clean):
    """A rank that finished says BYE: not a loss. One that closes after a failure
    (``with`` left by an exception) is."""
    w0, w1, codes = _pair()
    w1.close(clean=clean)
    time.sleep(1.5)  # past timeout_s: rank 1's silence no longer counts either
    if clean:
        assert w0.exit_code is None and codes == [], w0.events
        w0.close()
    else:
        assert w0.exit_code == watchdog.LOST_EXIT_CODE and codes == [3], w0.events
        assert "lost rank 1 (connection closed)" in w0.events[-1]


def test_watchdog_three_ranks_relay_loss_and_stop():
    """Rank 0 relays: a loss between rank 0 and rank 2 reaches rank 1 too, and a stop
    from rank 2 reaches everyone."""
    ws, codes = _group(3)
    ws[2].broadcast_stop("drain")
    _wait(lambda: len(codes) == 3, 3.0)
    assert codes == [0, 0, 0]
    assert all("stopping: drain (from rank 2)" in w.events for w in ws), [w.events for w in ws]

    ws, codes = _group(3)
    ws[2].close(clean=False)  # rank 2 gone without a word
    _wait(lambda: len(codes) == 2, 3.0)
    assert codes == [3, 3]
    assert ws[0].events[-1].startswith("lost rank 2 (connection closed)")
    assert ws[1].events[-1].startswith("lost rank 2 (connection closed; reported by rank 0)")


def test_watchdog_fail_tells_the_peers_why():
    """A rank that cannot go on (fail, or an uncaught exception through
    install_failure_hook) exits 1; the others exit 3 naming it and its reason, and
    keep the reason for the loader's handshake error (peer_failures)."""
    ws, codes = _group(3)
    _wait(lambda: all(c.pid == os.getpid() and c.local for c in ws[0].conns.values()), 2.0)
    ws[2].fail("CheckpointError: rank2/model-layer-003.safetensors is truncated")
    _wait(lambda: len(codes) == 2, 3.0)  # the failed rank's own exit is its main thread's
    assert ws[2].exit_code == 1 and ws[0].exit_code == ws[1].exit_code == 3, codes
    reason = "CheckpointError: rank2/model-layer-003.safetensors is truncated"
    assert ws[0].events[-1].startswith(f"lost rank 2 (failed: {reason})"), ws[0].events
    assert ws[1].events[-1].startswith(f"lost rank 2 (failed: {reason}; reported by rank 0)")
    assert ws[0].peer_failures == ws[1].peer_failures == {2: reason}

    ws, codes = _group(2)
    ws[0].fail("OSError: [Errno 98] Address already in use")
    _wait(lambda: len(codes) == 1, 3.0)
    assert (ws[0].exit_code, ws[1].exit_code) == (1, 3)
    assert ws[1].peer_failures == {0: "OSError: [Errno 98] Address already in use"}


def test_watchdog_refuses_strays_and_reports_an_absent_coordinator():
    w0 = Watchdog(0, 2, "127.0.0.1", 0, connect_timeout_s=1.0, hard_exit=lambda c: None)
    errors: list[Exception] = []

    def run() -> None:
        try:
            w0.start()
        except WatchdogError as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    stray = Watchdog(1, 3, "127.0.0.1", w0.port, connect_timeout_s=5.0)
    with pytest.raises(WatchdogError, match="group of 3, this one has 2"):
        stray.start()
    t.join(5)
    assert any("refused" in e for e in w0.events), w0.events
    assert len(errors) == 1 and "ranks [1] did not join" in str(errors[0])
    # Nothing listens there any more: a clear error naming the address, within the bound.
    t0 = time.monotonic()
    with pytest.raises(WatchdogError, match=f"127.0.0.1:{w0.port}.*within 0.5 s"):
        Watchdog(1, 2, "127.0.0.1", w0.port, connect_timeout_s=0.5).start()
    assert time.monotonic() - t0 < 2.0


def test_single_rank_stop_exits_zero():
    codes: list[int] = []
    w = Watchdog(0, 1, "127.0.0.1", 0, hard_exit=codes.append).start()
    w.broadcast_stop("alone")
    _wait(lambda: codes == [0], 2.0)


# ---------------------------------------------------------------- watchdog in processes


def _spawn(tmp: Path, rank: int, port: int) -> subprocess.Popen:
    log = open(tmp / f"rank{rank}.log", "w")  # a file: a full pipe must not stall a rank
    return subprocess.Popen(
        [
            sys.executable,
            str(PEER),
            "--rank",
            str(rank),
            "--size",
            "2",
            "--port",
            str(port),
            "--pid-dir",
            str(tmp),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )


@pytest.mark.parametrize(
    "victim,sig", [(1, signal.SIGKILL), (0, signal.SIGKILL), (1, signal.SIGTERM)]
)
def test_watchdog_processes(tmp_path, victim, sig):
    p0 = _spawn(tmp_path, 0, 0)
    port = int(wait_file(tmp_path / "rank0.port", p0, 15))
    p1 = _spawn(tmp_path, 1, port)
    procs = [p0, p1]
    try:
        for r, p in enumerate(procs):
            wait_file(tmp_path / f"rank{r}.pid", p, 15)
        time.sleep(1.0)
        assert p0.poll() is None and p1.poll() is None
        t0 = time.monotonic()
        procs[victim].send_signal(sig)
        survivor = procs[1 - victim]
        survivor.wait(timeout=10)
        dt = time.monotonic() - t0
        procs[victim].wait(timeout=10)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
    if sig == signal.SIGKILL:
        assert survivor.returncode == watchdog.LOST_EXIT_CODE, logs
        assert f"lost rank {victim} (connection closed)" in logs[1 - victim], logs
        assert dt < CLOSED_BOUND_S, dt
        print(f"\nSIGKILL rank {victim}: rank {1 - victim} exited 3 after {dt * 1000:.0f} ms")
    else:
        assert [p.returncode for p in procs] == [0, 0], logs
        for r in range(2):
            assert f"stopping: SIGTERM (from rank {victim})" in logs[r], logs
            assert f"on_stop rank {r}" in logs[r], logs
        print(f"\nSIGTERM rank {victim}: both ranks exited 0 within {dt * 1000:.0f} ms")


# ---------------------------------------------------------------- under mlx.launch


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_mlx_launch_peer_death_and_stop(tmp_path, sig):
    cmd = launch_cmd(2, PEER, "--launch", "--pid-dir", str(tmp_path))
    out = open(tmp_path / "launch.log", "w")
    launch = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, cwd=REPO
    )
    feed_stdin(launch.stdin)
    try:
        pids = [int(wait_file(tmp_path / f"rank{r}.pid", launch, 30)) for r in range(2)]
        time.sleep(1.0)  # both ranks in their all_sum loop
        t0 = time.monotonic()
        os.kill(pids[1], sig)
        launch.wait(timeout=20)  # the whole run ends, bounded
        dt = time.monotonic() - t0
    finally:
        if launch.poll() is None:
            launch.kill()
    text = (tmp_path / "launch.log").read_text()
    res = subprocess.CompletedProcess(cmd, launch.returncode, text, "")
    if sig == signal.SIGKILL:
        assert "[k3dist watchdog rank 0] lost rank 1 (connection closed)" in text, text
        assert "Node with rank 0 exited with code 3" in text, text
        assert failed_ranks(res) == {0, 1}
        print(f"\nmlx.launch, SIGKILL rank 1: run ended after {dt:.2f} s")
    else:
        for r in range(2):
            assert f"[k3dist watchdog rank {r}] stopping: SIGTERM (from rank 1)" in text, text
        assert failed_ranks(res) == set(), text
        print(f"\nmlx.launch, SIGTERM rank 1: both ranks stopped, run ended after {dt:.2f} s")
    assert dt < 10.0


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody reaps (an orphan's fate in a container)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def test_ranks_stop_when_mlx_launch_is_killed(tmp_path):
    """SIGKILL/SIGTERM to mlx.launch ends the launcher only; without the parent check
    its ranks were seen serving on, orphaned (2026-11-29)."""
    cmd = launch_cmd(2, PEER, "--launch", "--pid-dir", str(tmp_path), "--stop-with-launcher")
    launch = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO
    )
    feed_stdin(launch.stdin)
    pids = []
    try:
        pids = [int(wait_file(tmp_path / f"rank{r}.pid", launch, 30)) for r in range(2)]
        time.sleep(1.0)
        t0 = time.monotonic()
        launch.kill()
        launch.wait(timeout=10)
        while not all(_gone(p) for p in pids) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        dt = time.monotonic() - t0
        assert all(_gone(p) for p in pids), f"ranks {pids} still running {dt:.1f} s later"
        print(f"\nmlx.launch SIGKILLed: both ranks gone after {dt:.2f} s")
    finally:
        for p in pids:
            if not _gone(p):
                os.kill(p, signal.SIGKILL)
