"""mlx.launch under supervision: hosts checked first, an honest exit code, no rank left.

mlx.launch (MLX 0.32.4) has three gaps a supervisor (launchd, systemd, a script)
cannot work around from outside:

- it starts ``ssh`` with no connect timeout: a hostfile naming an unreachable host
  hangs with no output and no time limit;
- it returns 0 whatever its ranks did (it only logs ``Node with rank R exited with
  code C``);
- after one rank fails it SIGTERMs the others and waits for them without a bound: a
  rank that cannot take the signal (stopped with SIGSTOP, a wedged driver) keeps it
  waiting forever.

``run`` closes them. Before any rank starts, every host mlx.launch will reach over
ssh (every ``ssh`` name but ``127.0.0.1``, mlx.launch's own test) must answer
``ssh -o BatchMode=yes -o ConnectTimeout=N host test -x PYTHON`` within
``host_timeout_s`` (+5 s for the exchange), all hosts at once; a host that does not
is named with the fix and nothing starts (``k3dist.serve.hosts``). Then mlx.launch
runs in its own process group; its output passes through and two kinds of line are
read from it:

- mlx.launch's ``Node with rank R exited with code C``: a non-zero ``C`` is the exit
  code (a rank killed by signal N, ``C = -N``, gives ``128 + N``); of several, the
  first that is not 3 (the watchdog's "a peer was lost", which only says that rank
  went because another did: the other's code names the cause), else the first;
- the watchdog's ``[k3dist watchdog rank R] ... pid P)``: rank R's process on its
  host (ranks are the hostfile's hosts in order);
- the watchdog's ``lost rank L (why)``: when every report is a survivor's 3, the exit
  message names rank L and its host (its own exit never crossed a pulled cable).

Why read the output rather than have ranks write status files: it works unchanged
across machines (ssh hands the remote rank's exit status to mlx.launch, which
prints it), needs no shared folder, and the line is pinned with MLX (the tests read
it from a real mlx.launch, so a change of format fails them).

Idle: the wrapper waits on a pipe (signals, the pumps' failure lines, mlx.launch's
end), never a timed poll. mlx.launch's own per-rank thread selects on the rank's
stdin pipe, which is always writable, so it spins a core while its ranks run; it
lets go of that pipe once a write to it fails. So each rank closes its stdin at
start (``launch/serve.py``), and once every rank has announced its pid the wrapper
writes one line to mlx.launch's stdin: forwarded, it meets the closed pipe and
mlx.launch's threads then sleep in select. Ranks started over ssh: mlx.launch finds
``ssh`` on PATH, and the PATH it gets here starts with k3dist's shim
(``ssh_shim/ssh``), which gives the rank's ``ssh -tt`` stdin from /dev/null (the pipe
breaks at once), adds ``stty -onlcr`` (mlx.launch's pid-file path then comes back
without ``\r``, so its own remote kill works) and a connect timeout to its other ssh
calls.

Temp files: each rank announces mlx.launch's two temp files on its host (ring hostfile,
pid file; ``launch_files``), which mlx.launch leaves behind; they are removed when the
run ends (one ssh per host), or, for a host unreachable then, by the next run that
reaches it (``PENDING``).

A stop asked of the wrapper (SIGTERM, SIGINT, SIGHUP) goes to the ranks as SIGTERM
(those on this machine, else one over ssh): the watchdog stops the whole group, every
rank exits 0 and so does the wrapper. A second one does not wait.

After the first failure (or a stop asked of the wrapper), mlx.launch gets
``grace_s`` to end on its own: the watchdog normally ends every rank within a
second or two, and a frozen rank on the same machine is ended by its peers. If it
has not ended by then, its process group (mlx.launch, its local ranks, its ssh
clients) gets SIGTERM and SIGCONT, then SIGKILL after ``kill_grace_s``. Last, every
rank on another machine whose pid was announced and whose end mlx.launch did not
report is ended over ssh the same way (mlx.launch's own teardown only sends it
SIGTERM, which a stopped process never acts on).
"""

from __future__ import annotations

import json
import math
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from k3dist.serve.exit_codes import LOST_EXIT_CODE
from k3dist.serve.hosts import Host, ssh_command, ssh_each

# Exit code when nothing could be started (an unreachable host, bad arguments).
START_FAILED_EXIT_CODE = 2

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NODE = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|was killed)")
_PID = re.compile(r"\[k3dist watchdog rank (\d+)\] .*; pid (\d+)\)")
_LOST = re.compile(r"\[k3dist watchdog rank (\d+)\] lost rank (\d+) \((.*)\); exiting with code")
_FILES = re.compile(r"\[k3dist rank (\d+)\] mlx\.launch files on this host: (.*)")
# ssh's own exit code when the connection failed or was lost (a remote rank's "code")
SSH_FAILED = 255
# mlx.launch's temp files (ring hostfile, pid file) are mktemp's: only such names are removed
_MKTEMP = re.compile(r"^/[^\s'\"]*/tmp\.[A-Za-z0-9]+$")
# where the ssh shim lives (k3dist/serve/ssh_shim/ssh): first on mlx.launch's PATH
SSH_SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ssh_shim")


# ---------------------------------------------------------------- the supervised run


@dataclass
class _State:
    """What the output said so far (written by the pump threads)."""

    failures: list[tuple[int, int]] = field(default_factory=list)  # (rank, code) as reported
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid on its host
    ended: set[int] = field(default_factory=set)  # ranks whose exit mlx.launch saw
    lost: dict[int, tuple[int, str]] = field(default_factory=dict)  # reporter -> (rank, why)
    files: dict[int, list[str]] = field(default_factory=dict)  # rank -> mlx.launch's temp files
    lock: threading.Lock = field(default_factory=threading.Lock)
    wake_fd: int | None = None  # written when a line changed the state (run's wait)

    def wake(self) -> None:
        if self.wake_fd is not None:
            try:
                os.write(self.wake_fd, b"w")
            except OSError:
                pass  # full (a wake-up is pending anyway) or closed (run is done)

    def scan(self, line: str) -> None:
        line = _ANSI.sub("", line)
        # mlx.launch prints from one thread per rank: two reports can share a line.
        for m in _NODE.finditer(line):
            rank, code = int(m[1]), m[2]
            with self.lock:
                if code is not None:  # "was killed": sent SIGTERM, which may not have ended it
                    self.ended.add(rank)
                    if int(code) != 0:
                        self.failures.append((rank, int(code)))
        if m := _PID.search(line):
            with self.lock:
                self.pids[int(m[1])] = int(m[2])
        if lost := _LOST.search(line):
            with self.lock:
                self.lost.setdefault(int(lost[1]), (int(lost[2]), lost[3]))
        if files := _FILES.search(line):
            paths = [f for f in files[2].split() if _MKTEMP.match(f)]
            with self.lock:
                self.files[int(files[1])] = paths
        if self.failures or m:
            self.wake()

    @property
    def first_failure(self) -> tuple[int, int] | None:
        return self.failures[0] if self.failures else None

    def cause(self) -> tuple[int, int] | None:
        """The failure to report: the first whose code is not the watchdog's "a peer was
        lost" (3), which only says that rank went because another did; else the first."""
        with self.lock:
            causes = [f for f in self.failures if f[1] != LOST_EXIT_CODE]
            return (causes or self.failures or [None])[0]

    def lost_peer(self) -> tuple[int, int, str] | None:
        """(lost rank, reporting rank, why) when the failures are all the watchdog's
        "a peer was lost" (3) and a survivor named a rank that reported nothing else:
        the peer whose own exit never reached mlx.launch (its host or cable gone)."""
        with self.lock:
            if not self.failures or any(c != LOST_EXIT_CODE for _, c in self.failures):
                return None
            failed = {r for r, _ in self.failures}
            for reporter, (rank, why) in sorted(self.lost.items()):
                if rank not in failed:
                    return rank, reporter, why
            return None


# where the supervisor keeps clean-ups it could not do (a host unreachable at the end)
PENDING = Path.home() / ".cache" / "k3dist" / "pending-cleanup.json"


def _pending() -> dict[str, list[str]]:
    try:
        return json.loads(PENDING.read_text())
    except (OSError, ValueError):
        return {}


def _save_pending(pending: dict[str, list[str]]) -> None:
    try:
        if pending:
            PENDING.parent.mkdir(parents=True, exist_ok=True)
            tmp = PENDING.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(pending))
            os.replace(tmp, PENDING)
        else:
            PENDING.unlink(missing_ok=True)
    except OSError:
        pass


def remember_cleanup(host: str, paths: Sequence[str]) -> None:
    """mlx.launch temp files on ``host`` that could not be removed: the next run that
    reaches ``host`` removes them (``clean_pending``)."""
    pending = _pending()
    pending[host] = sorted(set(pending.get(host, [])) | set(paths))
    _save_pending(pending)


def clean_pending(hosts: Sequence[Host], log) -> None:
    """Remove the temp files an earlier run left on these hosts (bounded: one ssh per
    host, all at once; a host still unreachable keeps its entry)."""
    pending = _pending()
    todo = {h.ssh: pending[h.ssh] for h in hosts if h.ssh in pending and not h.local}
    if not todo:
        return
    done = ssh_each({host: f"rm -f {shlex.join(paths)}" for host, paths in todo.items()}, 15)
    for host, why in done.items():
        if why is None:
            log(f"removed {len(todo[host])} temp file(s) an earlier run left on {host}")
            pending.pop(host, None)
    _save_pending(pending)


def launch_files(pid: int | None = None) -> list[str]:
    """mlx.launch's temp files for this rank (call in the rank): the ring hostfile it
    exported as ``MLX_HOSTFILE`` and the pid file its start script wrote with this
    process's pid (``mktemp`` names, beside each other); [] when not started by it."""
    pid = os.getpid() if pid is None else pid
    hostfile = os.environ.get("MLX_HOSTFILE", "")
    if not _MKTEMP.match(hostfile):
        return []
    found = [hostfile]
    folder = os.path.dirname(hostfile)
    try:
        names = [n for n in os.listdir(folder) if n.startswith("tmp.")]
    except OSError:
        return found
    for name in names:
        path = os.path.join(folder, name)
        try:
            if path != hostfile and os.path.getsize(path) <= 16:
                with open(path) as f:
                    if f.read().strip() == str(pid):
                        found.append(path)
        except OSError:
            continue
    return found


def announce_launch_files(rank: int) -> None:
    """Say which mlx.launch temp files this rank has (the supervisor removes them when
    the run ends, on whichever host the rank ran)."""
    files = launch_files()
    if files:
        sys.stderr.write(f"[k3dist rank {rank}] mlx.launch files on this host: {' '.join(files)}\n")
        sys.stderr.flush()


def exit_code(code: int) -> int:
    """A process's return code as a shell reports it: -N (killed by signal N) -> 128+N."""
    return 128 - code if code < 0 else code


def _pump(src: BinaryIO, dst: BinaryIO, state: _State) -> None:
    for raw in iter(src.readline, b""):
        try:
            dst.write(raw)
            dst.flush()
        except (BrokenPipeError, ValueError):
            pass  # our own output is gone; keep reading so mlx.launch never blocks
        state.scan(raw.decode(errors="replace"))


def _end_group(pgid: int, kill_grace_s: float, log, leader: subprocess.Popen | None = None) -> None:
    """SIGTERM the process group, SIGKILL what is left after ``kill_grace_s``. SIGCONT
    follows the SIGTERM, so a stopped process can act on it (only SIGKILL ends a
    stopped one otherwise). ``leader``: reaped as it goes, so it does not linger as a
    zombie member of the group."""
    try:
        os.killpg(pgid, signal.SIGTERM)
        os.killpg(pgid, signal.SIGCONT)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + kill_grace_s
    while time.monotonic() < deadline:
        if leader is not None:
            leader.poll()
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
        log(f"sent SIGKILL to what was left of process group {pgid}")
    except ProcessLookupError:
        pass


def end_remote_rank_command(host: str, pid: int, kill_grace_s: float) -> list[str]:
    """ssh command that ends ``pid`` on ``host``: SIGTERM (and SIGCONT, for a stopped
    process), SIGKILL if still there after ``kill_grace_s`` (the same script runs under
    ``sh -c`` anywhere)."""
    ticks = max(1, math.ceil(kill_grace_s * 10))
    script = (
        f"kill -TERM {pid} 2>/dev/null || exit 0; kill -CONT {pid}; i=0; "
        f"while kill -0 {pid} 2>/dev/null && [ $i -lt {ticks} ]; do sleep 0.1; "
        f"i=$((i+1)); done; kill -KILL {pid} 2>/dev/null; exit 0"
    )
    return ssh_command(host, 5.0, script)


def run(
    launch_cmd: Sequence[str],
    hosts: Sequence[Host],
    *,
    grace_s: float = 5.0,
    kill_grace_s: float = 5.0,
    stdout: BinaryIO | None = None,
    stderr: BinaryIO | None = None,
) -> int:
    """Run mlx.launch (``launch_cmd``, hosts already checked), watch it, end it if it
    hangs, and return an honest exit code: 0 when no rank failed, else the first
    failing rank's code (``exit_code``), or the launcher's own non-zero code."""
    stdout = stdout or sys.stdout.buffer
    stderr = stderr or sys.stderr.buffer

    def log(msg: str) -> None:
        try:
            stderr.write(f"[k3dist run] {msg}\n".encode())
            stderr.flush()
        except (BrokenPipeError, ValueError):
            pass

    clean_pending(hosts, log)  # temp files an earlier run could not remove
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    state = _State(wake_fd=wake_w)
    proc, pumps = _start_launcher(launch_cmd, state, stdout, stderr)

    signals: list[int] = []
    previous = {}
    previous_wakeup = None
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            previous[s] = signal.signal(s, lambda signum, frame: signals.append(signum))
        previous_wakeup = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    try:
        escalated = _watch(proc, hosts, state, wake_r, signals, grace_s, kill_grace_s, log)
        proc.wait()
        if escalated or state.first_failure is not None or signals:
            _end_group(proc.pid, kill_grace_s, log)  # anything of ours still on this machine
        for t in pumps:
            t.join(2.0)  # a survivor holding the pipe must not hold the wrapper
        _end_remote(
            hosts,
            state,
            kill_grace_s,
            log,
            failed=escalated or state.first_failure is not None or proc.returncode != 0,
        )
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if previous_wakeup is not None:
            signal.set_wakeup_fd(previous_wakeup)
        state.wake_fd = None
        for fd in (wake_r, wake_w):
            os.close(fd)
        if proc.stdin:
            try:
                proc.stdin.close()
            except OSError:
                pass
    return _verdict(state, hosts, proc.returncode, log)


def _start_launcher(
    launch_cmd: Sequence[str], state: _State, stdout: BinaryIO, stderr: BinaryIO
) -> tuple[subprocess.Popen, list[threading.Thread]]:
    """mlx.launch in its own process group (the wrapper can end it and everything it
    started on this machine at once), stdin a pipe only the stdin release writes, its
    output pumped through ``state``; a thread wakes the watch loop when it ends.
    mlx.launch starts ``ssh`` from PATH: k3dist's shim first (SSH_SHIM_DIR's ssh)."""
    env = dict(os.environ)
    env["PATH"] = f"{SSH_SHIM_DIR}:{env.get('PATH', os.defpath)}"
    proc = subprocess.Popen(
        list(launch_cmd),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        process_group=0,
        env=env,
    )
    pumps = [
        threading.Thread(target=_pump, args=(src, dst, state), daemon=True)
        for src, dst in ((proc.stdout, stdout), (proc.stderr, stderr))
    ]
    for t in pumps:
        t.start()
    threading.Thread(target=lambda: (proc.wait(), state.wake()), daemon=True).start()
    return proc, pumps


def _watch(
    proc: subprocess.Popen,
    hosts: Sequence[Host],
    state: _State,
    wake_r: int,
    signals: list[int],
    grace_s: float,
    kill_grace_s: float,
    log: Callable[[str], None],
) -> bool:
    """Until mlx.launch ends: release its stdin once every rank is up, pass the first
    signal on as a group stop, give it ``grace_s`` after a stop or a failed rank, then
    end it. True when it had to be ended (escalated)."""
    deadline = math.inf
    handled = 0  # signals acted on
    stdin_released = False
    while proc.poll() is None:
        # Block until something happens: a signal, a failure or pid line, the end
        # of mlx.launch, or the deadline. No timed poll.
        timeout = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
        if select.select([wake_r], [], [], timeout)[0]:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        if not stdin_released and len(state.pids) >= len(hosts):
            stdin_released = _release_stdin(proc)
        now = time.monotonic()
        if len(signals) > handled:
            if handled == 0:
                _request_stop(proc.pid, signals[0], hosts, state, log)
                deadline = min(deadline, now + grace_s)
            else:  # asked twice: do not wait
                deadline = now
            handled = len(signals)
        if state.first_failure is not None and deadline == math.inf:
            rank, code = state.first_failure
            log(
                f"rank {rank} exited with code {code}; waiting up to {grace_s:g} s for "
                "mlx.launch to end the others"
            )
            deadline = now + grace_s
        if now >= deadline:
            log(
                f"mlx.launch did not end within {grace_s:g} s: ending it and its "
                f"local ranks (SIGTERM, SIGKILL after {kill_grace_s:g} s)"
            )
            _end_group(proc.pid, kill_grace_s, log, leader=proc)
            return True
    return False


def _verdict(
    state: _State, hosts: Sequence[Host], returncode: int, log: Callable[[str], None]
) -> int:
    """The exit code that names what failed: a lost peer (3), a failed rank's own
    code, mlx.launch's own non-zero code, else 0."""
    lost = state.lost_peer()
    if lost is not None:
        rank, reporter, why = lost
        log(
            f"exit code {LOST_EXIT_CODE}: lost rank {rank} on host {_where(hosts, rank)}: "
            f"rank {reporter} reported it ({why}); rank {rank}'s own exit never reached "
            f"this machine (every report: {state.failures})"
        )
        return LOST_EXIT_CODE
    cause = state.cause()
    if cause is not None:
        rank, code = cause
        rc = exit_code(code)
        how = f"it exited with {code}"
        if code == SSH_FAILED and rank < len(hosts) and not hosts[rank].local:
            how = (
                f"its ssh client exited with {code}: the rank was killed by a signal on "
                "its host, or the connection to the host was lost"
            )
        log(
            f"exit code {rc}: rank {rank} failed ({how}; every report: {state.failures}); "
            f"its host: {_where(hosts, rank)}"
        )
        return rc
    if returncode != 0:
        return exit_code(returncode)
    return 0


def _where(hosts: Sequence[Host], rank: int) -> str:
    return hosts[rank].ssh if rank < len(hosts) else "?"


def _release_stdin(proc: subprocess.Popen) -> bool:
    """One line to mlx.launch's stdin, once every rank runs (and has closed its stdin):
    mlx.launch forwards it to each rank's stdin pipe, the write fails, and its per-rank
    thread stops selecting on that always-writable pipe (which spun a core)."""
    try:
        os.write(proc.stdin.fileno(), b"\n")
        return True
    except OSError:
        return True  # mlx.launch is going; nothing to release


def _request_stop(pgid: int, signum: int, hosts: Sequence[Host], state: _State, log) -> None:
    """Pass a stop on as SIGTERM to the ranks (any rank's SIGTERM makes the watchdog stop
    the whole group, exit 0, and mlx.launch reports it): to this machine's directly,
    else to one on another machine over ssh (a hostfile may name this Mac by its
    hostname). Before any rank announced itself, to the whole process group."""
    with state.lock:
        running = {
            r: pid for r, pid in state.pids.items() if r < len(hosts) and r not in state.ended
        }
    name = signal.Signals(signum).name
    local = [pid for r, pid in running.items() if hosts[r].local]
    if local:
        log(f"{name}: stopping the group through its ranks here (pids {local})")
        for pid in local:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    elif running:
        r, pid = min(running.items())
        log(f"{name}: stopping the group through rank {r} (pid {pid} on {hosts[r].ssh})")
        cmd = ssh_command(hosts[r].ssh, 5.0, f"kill -TERM {pid}")
        subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    else:
        log(f"{name}: no rank has announced itself yet; stopping process group {pgid}")
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _end_remote(
    hosts: Sequence[Host], state: _State, kill_grace_s: float, log, failed: bool
) -> None:
    """Ranks on other machines that mlx.launch did not see end (after a failure), and
    every rank's mlx.launch temp files (its ring hostfile and pid file, which it never
    removes after a clean end, nor under ``ssh -tt``): one ssh per host, all at once."""
    with state.lock:
        left = {
            r: pid
            for r, pid in state.pids.items()
            if failed and r < len(hosts) and not hosts[r].local and r not in state.ended
        }
        files = {r: list(f) for r, f in state.files.items() if r < len(hosts) and f}
    scripts: dict[str, list[str]] = {}
    for r, paths in files.items():
        if hosts[r].local:
            for f in paths:
                try:
                    os.unlink(f)
                except OSError:
                    pass
        else:
            scripts.setdefault(hosts[r].ssh, []).append(f"rm -f {shlex.join(paths)}")
    for r, pid in left.items():
        log(
            f"rank {r} (pid {pid} on {hosts[r].ssh}) was not reported ended: ending it over "
            f"ssh (SIGTERM, SIGKILL after {kill_grace_s:g} s)"
        )
        scripts.setdefault(hosts[r].ssh, []).append(
            f"({end_remote_rank_command(hosts[r].ssh, pid, kill_grace_s)[-1]})"
        )
    done = ssh_each({h: "; ".join(parts) for h, parts in scripts.items()}, kill_grace_s + 15)
    for host, why in done.items():
        if why is not None:
            files_here = [f for r, paths in files.items() if hosts[r].ssh == host for f in paths]
            remember_cleanup(host, files_here)
            log(
                f"could not clean up on {host} over ssh ({why}): the next run that reaches "
                f"it removes the temp files; or, when it is back: "
                f"ssh {host} {shlex.quote('; '.join(scripts[host]))}"
            )
