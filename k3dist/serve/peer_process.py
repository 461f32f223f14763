"""Ending processes within a bound: this one (its stdio flushed first) and a frozen peer.

The watchdog's exits are hard (``os._exit``: the main thread may be blocked in a
collective that never returns), so stdio is flushed from a helper thread first. A
silent peer on this machine is ended with SIGTERM + SIGCONT, SIGKILL after a grace, so
its launcher sees it end. A user callback runs in its own thread so its wait is bounded.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from k3dist.serve.peer_link import Conn


def flush_stdio(timeout_s: float = 0.5) -> None:
    # os._exit skips Python's flush. Flush from a helper thread: a main thread
    # blocked mid-write could hold the stream's lock, and we must still exit.
    def flush() -> None:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass

    t = threading.Thread(target=flush, daemon=True)
    t.start()
    t.join(timeout_s)


def start_callback(fn: Callable | None, args: tuple) -> threading.Thread | None:
    """Run a user callback in its own thread, so the caller can bound the wait (join)."""
    if fn is None:
        return None
    t = threading.Thread(target=fn, args=args, daemon=True, name="k3dist-watchdog-callback")
    t.start()
    return t


def alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie awaiting its parent has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    status = Path(f"/proc/{pid}/status")
    if status.exists():  # Linux; macOS has no /proc and reaps through launchd
        try:
            return "\nState:\tZ" not in status.read_text()
        except OSError:
            return False
    return True


def end_local_peer(c: Conn, grace_s: float, log: Callable[[str], None]) -> None:
    """End a silent peer on this machine: SIGTERM, SIGKILL after ``grace_s``.
    SIGCONT follows the SIGTERM: a stopped process (SIGSTOP, Ctrl-Z, a debugger)
    acts on no signal but SIGKILL; resumed, it finds this rank's socket closed and
    exits on its own (code 3). A wedged one gets SIGKILL; either way its launcher
    then sees it exit. A peer on another machine is left to its launcher."""
    if not c.local or c.pid is None:
        where = "on another machine" if not c.local else "of unknown pid"
        log(f"rank {c.rank} is {where}: left to the launcher to end")
        return
    c.sock.close()  # resumed, the peer sees this rank gone at once
    try:
        os.kill(c.pid, signal.SIGTERM)
        os.kill(c.pid, signal.SIGCONT)
    except OSError:
        return  # already gone
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not alive(c.pid):
            log(f"rank {c.rank} (pid {c.pid}) ended after SIGTERM")
            return
        time.sleep(0.05)
    try:
        os.kill(c.pid, signal.SIGKILL)
        log(
            f"rank {c.rank} (pid {c.pid}) did not end within {grace_s:g} s of SIGTERM: sent SIGKILL"
        )
    except OSError:
        pass
