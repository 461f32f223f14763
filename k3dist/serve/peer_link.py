"""The watchdog's wire: where rank 0 listens, the star's join, one peer's line socket.

Rank 0 listens (``listen``) and takes one ``HELLO rank size`` line from each other rank
(``accept_peers``), answering ``READY`` once all have joined; the others connect,
retrying until their bound (``join_coordinator``). After the join each peer is a
``Conn``: a socket with a line buffer. What the lines mean is ``k3dist.serve.watchdog``'s.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import mlx.core as mx

# mlx.launch's default --starting-port; the watchdog sits PORT_OFFSET above rank
# 0's first ring port, clear of the ring's own ports (one per rank and connection).
DEFAULT_RING_PORT = 32323
PORT_OFFSET = 1000


class WatchdogError(RuntimeError):
    """The side channel could not be formed; the message says where and the fix."""


def coordinator_address(
    group: mx.distributed.Group | None = None,
    *,
    port: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[str, int]:
    """Where rank 0's watchdog listens: (rank 0's IP, its first ring port + 1000).

    mlx.launch (ring backend) hands every rank ``MLX_HOSTFILE``: a file holding a JSON
    list, per rank, of the "ip:port" pairs the ring uses; rank 0's first pair names
    its host. With jaccl, ``MLX_JACCL_COORDINATOR`` ("ip:port") does. With neither
    (one process) it is 127.0.0.1 and mlx.launch's default port + 1000. ``port``
    overrides the port (a deployment where that one is taken).
    """
    env = os.environ if environ is None else environ
    size = group.size() if group is not None else None
    path = env.get("MLX_HOSTFILE")
    text = Path(path).read_text().strip() if path and Path(path).exists() else ""
    if text:
        try:
            hosts = json.loads(text)
            host, ring_port = hosts[0][0].rsplit(":", 1)
            ring_port = int(ring_port)
        except (json.JSONDecodeError, IndexError, KeyError, TypeError, ValueError):
            raise WatchdogError(
                f"MLX_HOSTFILE {path}: expected the ring backend's JSON list "
                f"of per-rank ['ip:port', ...] lists, got {text[:200]!r}; "
                "pass the watchdog host and port explicitly"
            ) from None
        if size is not None and len(hosts) != size:
            raise WatchdogError(
                f"MLX_HOSTFILE {path} lists {len(hosts)} ranks but the group has {size}"
            )
    elif env.get("MLX_JACCL_COORDINATOR"):
        host, ring_port = env["MLX_JACCL_COORDINATOR"].rsplit(":", 1)
        ring_port = int(ring_port)
    else:
        host, ring_port = "127.0.0.1", DEFAULT_RING_PORT
    return host, port if port is not None else ring_port + PORT_OFFSET


class Conn:
    """One peer socket with a line buffer. Protocol: ASCII lines, see Watchdog."""

    def __init__(self, sock: socket.socket, rank: int):
        self.sock, self.rank = sock, rank
        self.buf = b""
        self.last_seen = time.monotonic()
        self.acked = False  # acknowledged a stop
        self.left = False  # said BYE: left normally
        self.pid: int | None = None  # the peer's process id (its PID line)
        self.send_lock = threading.Lock()  # the watchdog thread and the wake-ups send
        # Same machine: the peer connects from this socket's own address (loopback, or
        # one interface talking to itself). Only then can a pid be signalled.
        try:
            self.local = sock.getpeername()[0] == sock.getsockname()[0]
        except OSError:
            self.local = False

    def send(self, line: str) -> None:
        with self.send_lock:
            self.sock.sendall(line.encode() + b"\n")

    def read_lines(self) -> list[str] | None:
        """Lines available now; None once the peer has closed (EOF or reset)."""
        try:
            data = self.sock.recv(4096)
        except (ConnectionError, TimeoutError, OSError):
            return None
        if not data:
            return None
        self.last_seen = time.monotonic()
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        return [x.decode(errors="replace") for x in lines]


def read_line(sock: socket.socket, deadline: float) -> str | None:
    """A single line during the join, before the event loop; None on EOF or deadline."""
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        sock.settimeout(left)
        try:
            b = sock.recv(1)
        except (TimeoutError, OSError):
            return None
        if not b:
            return None
        buf += b
    return buf[:-1].decode(errors="replace")


def listen(host: str, port: int, size: int) -> socket.socket:
    """Rank 0's listening socket, bound now: peers that come up first queue in the
    backlog instead of retrying, and port=0 (tests) is resolved before they need it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as e:
        s.close()
        raise WatchdogError(
            f"rank 0 cannot listen on {host}:{port} ({e}); another run may hold the "
            "port: stop it, or pick another watchdog port on every rank"
        ) from None
    s.listen(max(8, size))
    return s


def check_hello(hello: str | None, size: int, joined: Mapping[int, Conn]) -> tuple[int, str | None]:
    """(rank, None) for a valid newcomer, else (-1, what is wrong with it)."""
    parts = (hello or "").split()
    if not (len(parts) == 3 and parts[0] == "HELLO" and parts[1].isdigit() and parts[2].isdigit()):
        return -1, f"sent {hello!r}, not HELLO rank size"
    r, n = int(parts[1]), int(parts[2])
    if n != size:
        return -1, f"is from a group of {n}, this one has {size}"
    if not 0 < r < size:
        return -1, f"claims rank {r}, outside 1..{size - 1}"
    if r in joined:
        return -1, f"claims rank {r}, which already joined"
    return r, None


def accept_peers(
    listener: socket.socket,
    size: int,
    *,
    connect_timeout_s: float,
    timeout_s: float,
    log: Callable[[str], None],
) -> dict[int, Conn]:
    """Rank 0: take every other rank's HELLO within ``connect_timeout_s``, then send
    each ``READY``; closes the listener either way. A stray connection (an old run, a
    wrong hostfile) is refused with ``ERR`` and takes no slot."""
    host, port = listener.getsockname()[:2]
    deadline = time.monotonic() + connect_timeout_s
    conns: dict[int, Conn] = {}
    try:
        while len(conns) < size - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, size)) - set(conns))
                raise WatchdogError(
                    f"rank 0: ranks {missing} did not join the watchdog on {host}:{port} "
                    f"within {connect_timeout_s:g} s; check that they started and can "
                    "reach this address (firewall, hostfile IPs)"
                )
            listener.settimeout(left)
            try:
                sock, addr = listener.accept()
            except TimeoutError:
                continue
            hello = read_line(sock, min(deadline, time.monotonic() + 5.0))
            r, problem = check_hello(hello, size, conns)
            if problem:
                log(f"refused a watchdog connection from {addr[0]}: it {problem}")
                try:
                    sock.sendall(f"ERR {problem}\n".encode())
                except OSError:
                    pass
                sock.close()
                continue
            conns[r] = Conn(sock, r)
        for c in conns.values():
            c.sock.settimeout(timeout_s)  # a send can never block past the bound
            c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c.send("READY")
            c.last_seen = time.monotonic()
    except BaseException:
        for c in conns.values():
            c.sock.close()
        raise
    finally:
        listener.close()
    return conns


def join_coordinator(
    rank: int, size: int, host: str, port: int, *, connect_timeout_s: float, timeout_s: float
) -> Conn:
    """A rank other than 0: connect to rank 0 and say HELLO, retrying until
    ``connect_timeout_s``, until rank 0 answers READY (all ranks joined)."""
    deadline = time.monotonic() + connect_timeout_s
    last = "no attempt"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WatchdogError(
                f"rank {rank}: the watchdog coordinator (rank 0) at {host}:{port} did not "
                f"let this rank join within {connect_timeout_s:g} s (last: {last}); check "
                "that rank 0 is running and listening there, that the port is free and "
                "reachable, or pass the same watchdog port to every rank"
            )
        try:
            sock = socket.create_connection((host, port), timeout=min(left, 5.0))
        except OSError as e:
            last = f"connect: {e}"
            time.sleep(min(0.2, max(0.0, left)))
            continue
        sock.sendall(f"HELLO {rank} {size}\n".encode())
        reply = read_line(sock, deadline)
        if reply == "READY":
            sock.settimeout(timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return Conn(sock, 0)
        sock.close()
        if reply is not None and reply.startswith("ERR "):
            raise WatchdogError(
                f"rank {rank}: rank 0 refused this rank: it {reply[4:]}; launch every "
                "rank with the same group"
            )
        last = f"rank 0 closed before all ranks joined ({reply!r})"
