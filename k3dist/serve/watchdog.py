"""The peer watchdog of a multi-rank serve.

``Watchdog``: a TCP side channel beside the MLX group. When a peer dies, the
ring backend on the survivor may fail the pending collective, return garbage, or
block forever; nothing in MLX ends the run. The watchdog notices (a closed
socket at once, a silent peer after ``timeout_s``) and hard-exits every survivor
with a line that names the lost rank. It also carries a requested shutdown
(SIGTERM/SIGINT on any rank stops all ranks with exit code 0). Kept ours: MLX has
no liveness check for a group, and mlx_lm.server none for its peers.

Exit codes: 0 after a requested stop, 3 (``LOST_EXIT_CODE``) after a lost peer,
1 after this rank failed (``Watchdog.fail``: the peers are told why).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import select
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

from k3dist.serve import peer_link, peer_process
from k3dist.serve.exit_codes import LOST_EXIT_CODE
from k3dist.serve.peer_link import Conn


class Watchdog:
    """Peer liveness and shutdown for a group of ranks, over plain TCP (a star).

    Rank 0 listens on ``port``; every other rank connects (retrying until
    ``connect_timeout_s``) and says ``HELLO rank size``; rank 0 answers ``READY``
    once all have joined, so ``start()`` returns on every rank together. Then a
    thread on each rank sends ``H`` every ``interval_s`` and watches its sockets:

    - a peer's socket closes (process killed, crashed, machine rebooted): lost at
      once (< 1 s); a peer silent for ``timeout_s`` (hung machine, cable pulled):
      lost then. Rank 0 relays ``LOST r reason`` to the other ranks, so every
      survivor logs ``lost rank r (reason)`` and exits with code 3 within
      ``timeout_s + interval_s``.
    - ``broadcast_stop(reason)`` on any rank: the request goes to rank 0, which
      relays ``STOP origin reason`` to all; each rank logs
      ``stopping: reason (from rank origin)``, acknowledges, runs ``on_stop``
      (at most ``stop_work_s + stop_grace_s``: ``stop_work_s`` is what on_stop's own
      bounded work may take, e.g. the prefix store's drain) and exits with code 0;
      rank 0 waits (same bound)
      for the acknowledgements first, so it is the last to go. A peer whose socket
      closes without acknowledging was lost, not stopped: exit 3.
    - ``parent_pid`` (the launcher): once this process's parent is another, the
      launcher died and the rank asks for the group stop above (checked every beat).
    - ``close()`` (or leaving a ``with`` block without an exception) says ``BYE``:
      a rank that finished its work normally is not a loss.
    - ``fail(reason)``: this rank cannot go on (a bad folder, a port in use); the
      peers are told why (``FAIL``), log ``lost rank r (failed: reason)`` and exit 3
      at once; this rank exits 1 (``install_failure_hook`` calls it on an uncaught
      exception).
    - Idle wake-ups (``wake_peers`` on rank 0, ``wait_wake`` on the others): a rank
      with nothing to do blocks here instead of inside a collective (the ring
      backend's collectives spin while they wait); rank 0 sends ``W`` just before
      the collective that shares a request, and each other rank enters it after
      taking one ``W``.
    - Stats (``stats``, ranks other than 0): a small dict of this rank's figures sent
      with every heartbeat as ``M <json>``; rank 0 keeps each peer's latest with the
      time it came (``peer_stats``) for ``k3dist.serve.metrics``: no collective.
    - A silent peer on the same machine (frozen: SIGSTOP, a debugger, a wedged
      driver) is ended before the survivor exits: SIGTERM + SIGCONT (a stopped
      process resumes, sees the group gone and exits), SIGKILL after
      ``stop_grace_s``, so the launcher sees it end. Every rank tells its peers its
      pid (``PID``) after the join; a peer on another machine is left to the
      launcher (``k3dist.serve.supervise``). A rank that was itself stopped reads its
      sockets before it judges anyone silent.

    Why exits are hard (``os._exit``): the main thread may be blocked inside a
    collective whose peer is gone; it never returns to Python, so no exception or
    ``sys.exit`` can reach it. Ending the process is the only bounded way out.
    MLX releases the GIL while it evaluates, so this thread runs during a blocked
    collective. No collective is ever issued here (collectives must be issued in
    the same order on every rank; a side thread would break that).

    ``hard_exit`` is for in-process tests only (record the code instead of exiting).
    """

    def __init__(
        self,
        group_rank: int,
        group_size: int,
        coordinator_host: str,
        port: int,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 10.0,
        connect_timeout_s: float = 60.0,
        stop_grace_s: float = 2.0,
        stop_work_s: float = 0.0,
        on_lost: Callable[[int, str], None] | None = None,
        on_stop: Callable[[str, int], None] | None = None,
        parent_pid: int | None = None,
        kill_silent_peers: bool = True,
        hard_exit: Callable[[int], None] = os._exit,
    ):
        if not 0 <= group_rank < group_size:
            raise ValueError(f"rank {group_rank} is outside a group of {group_size}")
        if not 0 < interval_s < timeout_s:
            raise ValueError(
                f"need 0 < interval_s ({interval_s}) < timeout_s ({timeout_s}): a "
                "peer must get several heartbeats in before it counts as silent"
            )
        self.rank, self.size = group_rank, group_size
        self.host, self.port = coordinator_host, port
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.connect_timeout_s, self.stop_grace_s = connect_timeout_s, stop_grace_s
        # what on_stop may take beyond stop_grace_s (the prefix store's bounded drain)
        self.stop_work_s = stop_work_s
        self.on_lost, self.on_stop, self._hard_exit = on_lost, on_stop, hard_exit
        # The launcher's pid: when it exits (SIGTERM/SIGKILL to mlx.launch kills only
        # the launcher), this rank is re-parented and stops instead of serving on orphaned.
        self.parent_pid = parent_pid
        self.kill_silent_peers = kill_silent_peers
        self.peer_failures: dict[int, str] = {}  # rank -> the reason it sent with FAIL
        self.conns: dict[int, Conn] = {}
        # this rank's figures for rank 0 (set after start-up); rank 0: what peers sent
        self.stats: Callable[[], dict] | None = None
        self.peer_stats: dict[int, tuple[float, dict]] = {}
        self.exit_code: int | None = None  # what the watchdog exited (or would exit) with
        self.events: list[str] = []  # every line it logged, for tests and post-mortems
        self._decided = threading.Event()  # set once exit_code is final
        self._thread: threading.Thread | None = None
        self._ctl_r, self._ctl_w = os.pipe()  # requests from other threads/signal handlers
        for fd in (self._ctl_r, self._ctl_w):
            os.set_blocking(fd, False)
        self._sig_r: int | None = None
        self._stop_signals: frozenset[int] = frozenset()
        self._stopping = False  # STOP received (peer) or begun (rank 0)
        self._requested = False  # a peer asked rank 0 to stop, awaiting the relay
        self._stop_deadline = math.inf
        self._stop_cb: threading.Thread | None = None
        self._wakes = threading.Semaphore(0)  # W lines from rank 0 not yet taken
        self._listener: socket.socket | None = None
        if self.rank == 0 and self.size > 1:
            # Listen now, not in start(): peers that come up first queue in the backlog.
            self._listener = peer_link.listen(coordinator_host, port, self.size)
            self.port = self._listener.getsockname()[1]

    def start(self) -> Watchdog:
        """Form the star (blocks until every rank has joined), then start watching."""
        if self.size > 1:
            if self.rank == 0:
                assert self._listener is not None
                self.conns = peer_link.accept_peers(
                    self._listener,
                    self.size,
                    connect_timeout_s=self.connect_timeout_s,
                    timeout_s=self.timeout_s,
                    log=self._log,
                )
            else:
                self.conns[0] = peer_link.join_coordinator(
                    self.rank,
                    self.size,
                    self.host,
                    self.port,
                    connect_timeout_s=self.connect_timeout_s,
                    timeout_s=self.timeout_s,
                )
        for c in self.conns.values():
            try:
                c.send(f"PID {os.getpid()}")
            except OSError:
                pass  # gone already: the loop will see it
        # k3dist.serve.supervise reads "pid N" from this line: the rank's process to end if
        # the group is torn down.
        self._log(
            f"{self.size} rank(s) joined via {self.host}:{self.port} (heartbeat "
            f"{self.interval_s:g} s, lost after {self.timeout_s:g} s of silence; pid "
            f"{os.getpid()})",
            quiet=self.size == 1,
        )
        self._thread = threading.Thread(target=self._run, daemon=True, name="k3dist-watchdog")
        self._thread.start()
        atexit.register(self._at_exit)
        return self

    # ------------------------------------------------------------ requests

    def wake_peers(self) -> None:
        """Rank 0: tell every other rank to enter the next collective (``W``). A peer
        that cannot be told is gone; the watchdog loop reports that."""
        for c in list(self.conns.values()):
            try:
                c.send("W")
            except OSError:
                pass

    def wait_wake(self, timeout_s: float) -> bool:
        """Other ranks: block until rank 0's next ``W`` (True) or ``timeout_s`` (False)."""
        return self._wakes.acquire(timeout=timeout_s)

    def broadcast_stop(self, reason: str) -> None:
        """Stop every rank (exit 0). Safe from any thread and from a signal handler:
        it only writes to a pipe (no locks) that the watchdog thread reads."""
        line = "S " + " ".join(str(reason).split())[:200]
        try:
            os.write(self._ctl_w, line.encode() + b"\n")
        except (BlockingIOError, OSError):
            pass  # pipe full: stops already queued; closed: the watchdog is gone

    def fail(self, reason: str, wait_s: float = 1.0) -> None:
        """This rank cannot go on: tell the peers why (they exit 3 naming it), stop
        watching, and let this process exit 1 (the next ``_at_exit``). Returns once
        the peers were told (at most ``wait_s``); safe from any thread."""
        line = "F " + " ".join(str(reason).split())[:400]
        try:
            os.write(self._ctl_w, line.encode() + b"\n")
        except (BlockingIOError, OSError):
            return
        self._decided.wait(wait_s)

    def close(self, *, clean: bool = True) -> None:
        """Stop watching without exiting. ``clean``: tell the peers this rank finished
        normally (BYE); otherwise they see a loss, which is right after a failure."""
        atexit.unregister(self._at_exit)
        if self._thread is None or not self._thread.is_alive():
            self._close_sockets(clean)
            return
        try:
            os.write(self._ctl_w, b"B\n" if clean else b"C\n")
        except OSError:
            pass
        self._thread.join(self.timeout_s)

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(clean=exc_type is None)

    def watch_signals(self, fd: int, signals: tuple[int, ...]) -> None:
        """Stop every rank when ``signals`` arrive on wakeup fd ``fd``."""
        self._stop_signals = frozenset(int(s) for s in signals)
        self._sig_r = fd
        if self._thread is not None:  # wake the loop so it registers the fd
            os.write(self._ctl_w, b"W\n")

    # ------------------------------------------------------------ the loop

    def _log(self, msg: str, quiet: bool = False) -> None:
        self.events.append(msg)
        if quiet:
            return
        # os.write, not print: no Python-level lock a blocked main thread might hold.
        try:
            os.write(2, f"[k3dist watchdog rank {self.rank}] {msg}\n".encode())
        except OSError:
            pass

    def _close_sockets(self, clean: bool) -> None:
        for c in self.conns.values():
            if clean and not c.left:
                try:
                    c.send("BYE")
                except OSError:
                    pass
            c.sock.close()
        self.conns.clear()
        if self._listener is not None:
            self._listener.close()

    def _exit(self, code: int) -> None:
        self.exit_code = code
        self._decided.set()
        peer_process.flush_stdio(0.2)
        self._hard_exit(code)

    def _at_exit(self) -> None:
        """The main thread is leaving Python without close(): finish the exit here.

        Why: when a collective fails ("[ring] connection to a peer was lost"), the main
        thread raises while this thread is deciding; interpreter shutdown then freezes
        daemon threads (this one) and can itself hang in the ring backend, so the
        process would end only by mlx.launch's SIGTERM, with the wrong code. Exiting
        from the main thread's atexit keeps the watchdog's code (3) and bounds it.
        """
        if self._hard_exit is not os._exit:
            return  # in-process tests: never end the test runner
        uncaught = getattr(sys, "last_value", None) is not None
        stopping = self._stopping or self._requested  # e.g. on_stop ended the server
        if self.exit_code is None and (uncaught or stopping):
            # The watchdog usually has seen the closed socket or finished the stop.
            self._decided.wait(self.stop_work_s + self.stop_grace_s + 1.0)
        if self.exit_code is not None or uncaught or stopping:
            peer_process.flush_stdio(0.2)
            os._exit(self.exit_code if self.exit_code is not None else 1 if uncaught else 0)

    def _lost(self, rank: int, reason: str, silent: Conn | None = None) -> None:
        self.exit_code = LOST_EXIT_CODE  # first: the main thread's atexit may read it
        if self.rank == 0:
            for c in self.conns.values():
                if c.rank != rank:
                    try:
                        c.send(f"LOST {rank} {reason}")
                    except OSError:
                        pass
        self._log(
            f"lost rank {rank} ({reason}); exiting with code {LOST_EXIT_CODE}: the "
            "group cannot continue without it"
        )
        t = peer_process.start_callback(self.on_lost, (rank, reason))
        deadline = time.monotonic() + self.stop_grace_s
        if silent is not None and self.kill_silent_peers:
            peer_process.end_local_peer(silent, self.stop_grace_s, self._log)
        if t is not None:
            t.join(max(0.0, deadline - time.monotonic()))
        self._exit(LOST_EXIT_CODE)

    def _beat_line(self) -> str:
        """``H``, or on a rank with ``stats`` ``M <json>`` (a heartbeat that also
        carries the figures). A failing callback costs the figures, never the beat."""
        if self.stats is None or self.rank == 0:
            return "H"
        try:
            return "M " + json.dumps(self.stats(), separators=(",", ":"))
        except Exception:  # noqa: BLE001 - liveness first
            return "H"

    def _failed(self, reason: str) -> None:
        """This rank failed (``fail``): tell the peers, then stop watching (exit 1)."""
        # A peer that is already gone (or failed first) is a loss, exit 3, not this
        # rank's failure: the exception that led here may be the collective that
        # noticed it. Read what the peers have sent before deciding.
        for c in list(self.conns.values()):
            while select.select([c.sock], [], [], 0)[0]:
                lines = c.read_lines()
                if lines is None:
                    self._lost(c.rank, self.peer_failures.get(c.rank, "connection closed"))
                    return
                if any(self._on_line(c, line) for line in lines):
                    return
        self.exit_code = 1
        for c in self.conns.values():
            try:
                c.send(f"LOST 0 failed: {reason}" if self.rank == 0 else f"FAIL {reason}")
            except OSError:
                pass
        self._log(f"failed: {reason}; exiting with code 1")
        self._decided.set()

    def _begin_stop(self, origin: int, reason: str) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._log(f"stopping: {reason} (from rank {origin})")
        for c in list(self.conns.values()):
            try:
                c.send(f"STOP {origin} {reason}" if self.rank == 0 else "ACK")
            except OSError:
                pass  # a peer that is gone shows up as a close without ACK
        if self.on_stop is not None:
            self._stop_cb = peer_process.start_callback(self._stop_then_wake, (reason, origin))
        self._stop_deadline = time.monotonic() + self.stop_work_s + self.stop_grace_s

    def _stop_then_wake(self, reason: str, origin: int) -> None:
        """``on_stop``, then a wake-up for the loop: the rank goes as soon as its stop
        work is done, not at the next heartbeat (up to ``interval_s`` later)."""
        try:
            self.on_stop(reason, origin)
        finally:
            try:
                os.write(self._ctl_w, b"W\n")  # no request: only wakes the loop
            except OSError:
                pass

    def _stop_done(self) -> bool:
        cb_done = self._stop_cb is None or not self._stop_cb.is_alive()
        if self.rank != 0:
            return cb_done  # peers go as soon as their callback is done
        return cb_done and not self.conns  # rank 0 goes last: all peers acked and closed

    def _request_stop(self, reason: str) -> None:
        if self._stopping or self._requested:
            return
        if self.rank == 0 or 0 not in self.conns:
            self._begin_stop(self.rank, reason)
            return
        self._requested = True
        try:
            self.conns[0].send(f"STOP {self.rank} {reason}")
        except OSError as e:
            self._lost(0, f"could not send the stop request: {e}")

    def _on_line(self, c: Conn, line: str) -> bool:
        """Handle one message; True when the loop must end (the process exits)."""
        kind, _, rest = line.partition(" ")
        if kind == "H":
            return False
        if kind == "M":
            try:
                self.peer_stats[c.rank] = (time.monotonic(), json.loads(rest))
            except ValueError:
                pass  # a garbled report is not a loss: the next beat brings another
            return False
        if kind == "W":
            self._wakes.release()
            return False
        if kind == "PID" and rest.isdigit():
            c.pid = int(rest)
        elif kind == "FAIL":
            self.peer_failures[c.rank] = rest
            self._lost(c.rank, f"failed: {rest}")
            return True
        elif kind == "STOP":
            origin, _, reason = rest.partition(" ")
            self._begin_stop(int(origin), reason)
        elif kind == "ACK":
            c.acked = True
        elif kind == "BYE":
            c.left = True
        elif kind == "LOST" and self.rank != 0:
            r, _, reason = rest.partition(" ")
            if reason.startswith("failed: "):
                self.peer_failures[int(r)] = reason.removeprefix("failed: ")
            self._lost(int(r), f"{reason}; reported by rank 0")
            return True
        return False

    def _on_close(self, c: Conn, sel: selectors.BaseSelector) -> bool:
        sel.unregister(c.sock)
        c.sock.close()
        del self.conns[c.rank]
        if c.left or c.acked or (self._stopping and self.rank != 0):
            return False  # finished, or stopping as asked: not a loss
        self._lost(
            c.rank,
            "connection closed" + (" without acknowledging the stop" if self._stopping else ""),
        )
        return True

    def _peer_closed(self, sel: selectors.BaseSelector) -> bool:
        """Read the peers' sockets that have something now (not waiting): True when one
        has closed and that was handled as a loss. Before a stop request is acted on:
        a frozen rank 0 resumed by its peer's SIGTERM (after the peer closed its socket)
        saw the signal in one select and the close only in the next."""
        conns = list(self.conns.values())
        ready = select.select([c.sock for c in conns], [], [], 0)[0] if conns else []
        for c in conns:
            if c.sock not in ready or c.rank not in self.conns:
                continue
            lines = c.read_lines()
            if lines is None:
                if self._on_close(c, sel):
                    return True
                continue
            if any(self._on_line(c, line) for line in lines):
                return True
        return False

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as e:  # noqa: BLE001 - an unwatched rank must not keep serving
            self._log(
                f"watchdog failed ({type(e).__name__}: {e}); exiting with code "
                f"{LOST_EXIT_CODE} because peer loss can no longer be detected"
            )
            self._exit(LOST_EXIT_CODE)
        finally:
            self._close_sockets(clean=False)

    def _loop(self) -> None:
        sel = selectors.DefaultSelector()
        for c in self.conns.values():
            sel.register(c.sock, selectors.EVENT_READ, c)
        sel.register(self._ctl_r, selectors.EVENT_READ, "ctl")
        sig_registered = None
        next_beat = last_tick = time.monotonic()
        while True:
            if self._sig_r is not None and sig_registered != self._sig_r:
                sel.register(self._sig_r, selectors.EVENT_READ, "sig")
                sig_registered = self._sig_r
            now = time.monotonic()
            gap, last_tick = now - last_tick, now
            # After a gap this loop did not run (the process was stopped, or starved of
            # CPU), the peers' silence may be its own: read what they sent (a closed
            # socket says the group is gone) before judging anyone silent.
            judge = gap <= 2 * self.interval_s
            if gap > self.timeout_s / 2:
                self._log(f"this rank did not run for {gap:.1f} s (stopped, or starved of CPU)")
            if now >= next_beat:
                beat = self._beat_line()
                for c in list(self.conns.values()):
                    try:
                        c.send(beat)
                    except OSError as e:
                        if not (c.left or c.acked or (self._stopping and self.rank != 0)):
                            # what it sent before it went names why (its FAIL line)
                            if not self._peer_closed(sel):
                                self._lost(c.rank, f"heartbeat send failed: {e}")
                            return
                next_beat = now + self.interval_s
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    self._request_stop(f"launcher (pid {self.parent_pid}) exited")
            for c in list(self.conns.values()) if judge else ():
                if not c.left and now - c.last_seen > self.timeout_s:
                    self._lost(c.rank, f"silent for {now - c.last_seen:.1f} s", silent=c)
                    return
            if self._stopping and (self._stop_done() or now >= self._stop_deadline):
                if self.rank == 0 and self.conns and now >= self._stop_deadline:
                    self._log(
                        f"ranks {sorted(self.conns)} did not finish stopping within "
                        f"{self.stop_work_s + self.stop_grace_s:g} s; exiting anyway"
                    )
                self._exit(0)
                return
            wake = min(
                [next_beat, self._stop_deadline]
                + [c.last_seen + self.timeout_s for c in self.conns.values()]
            )
            events = sel.select(max(0.0, min(wake - now, self.interval_s)) if judge else 0)
            # Sockets before requests: a peer that is already gone is a loss, even when
            # a stop (e.g. mlx.launch's SIGTERM after that very death) arrives with it.
            events.sort(key=lambda e: isinstance(e[0].data, str))
            for key, _ in events:
                if isinstance(key.data, str) and self._peer_closed(sel):
                    return  # a stop that follows a peer's end (its SIGTERM) is a loss
                if key.data == "ctl":
                    data = os.read(self._ctl_r, 4096).decode(errors="replace")
                    for line in data.splitlines():
                        if line.startswith("S "):
                            self._request_stop(line[2:])
                        elif line.startswith("F "):
                            self._failed(line[2:])
                            return
                        elif line in ("B", "C"):
                            self._close_sockets(clean=line == "B")
                            return
                elif key.data == "sig":
                    try:
                        sigs = os.read(self._sig_r, 64)
                    except BlockingIOError:
                        sigs = b""
                    for s in sigs:
                        # The wakeup fd carries every signal that has a Python handler
                        # (transformers' SIGALRM prompt timer too): stop only on ours.
                        if s in self._stop_signals:
                            self._request_stop(signal.Signals(s).name)
                else:
                    c = key.data
                    if c.rank not in self.conns:
                        continue
                    lines = c.read_lines()
                    if lines is None:
                        if self._on_close(c, sel):
                            return
                        continue
                    for line in lines:
                        if self._on_line(c, line):
                            return


def install_signal_handlers(
    watchdog: Watchdog,
    signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP),
) -> None:
    """SIGTERM/SIGINT/SIGHUP on this rank stop every rank (exit 0). Call from the main
    thread. SIGHUP: a rank started over ``ssh -tt`` (mlx.launch on another Mac) gets it
    from sshd when its ssh client goes (mlx.launch ended, the supervisor's clean-up),
    and that is a stop, not a crash with Python's default action.

    A Python signal handler runs only when the main thread is back in Python, which
    a rank blocked in a collective never is. So the signal is also delivered through
    ``signal.set_wakeup_fd`` (written by the C-level handler at once) to the
    watchdog thread; the Python handler is the fallback if other code replaces the
    wakeup fd (asyncio does; mlx_lm.server does not use asyncio).
    """
    r, w = os.pipe()
    for fd in (r, w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)

    def handler(signum: int, frame) -> None:
        watchdog.broadcast_stop(signal.Signals(signum).name)

    for s in signals:
        signal.signal(s, handler)
    watchdog.watch_signals(r, signals)


def install_failure_hook(watchdog: Watchdog) -> None:
    """An uncaught exception on this rank (a bad folder, a port in use) is sent to the
    peers before the process exits, so they say why the group ended instead of
    "connection closed"; this rank exits 1 without waiting for a loss to be noticed."""
    previous = sys.excepthook

    def hook(kind, value, tb) -> None:
        previous(kind, value, tb)  # this rank's own traceback first
        if not issubclass(kind, KeyboardInterrupt):
            watchdog.fail(f"{kind.__name__}: {value}")

    sys.excepthook = hook
