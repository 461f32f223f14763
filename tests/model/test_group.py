"""Joining the group when a peer starts late (k3dist.model.group.join), on the real ring
backend over loopback: two processes given the ring's hostfile and ranks directly, the
way mlx.launch starts them, rank 0 held back until rank 1's first try has failed."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

from util import REPO, free_base_port

RANK = """
import sys, mlx.core as mx
from k3dist.model.group import join
g = join(float(sys.argv[1]))
print("sum", mx.distributed.all_sum(mx.array([g.rank() + 1.0]), group=g).item(), flush=True)
"""


def _rank(rank: int, hostfile, connect_s: float) -> subprocess.Popen:
    env = {"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile), "PATH": "/usr/bin:/bin"}
    return subprocess.Popen(
        [sys.executable, "-c", RANK, str(connect_s)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_rank_whose_peer_starts_late_joins_on_a_later_try(tmp_path):
    port = free_base_port(2)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    late = _rank(1, hostfile, 120)  # rank 1 connects to rank 0, which is not there yet
    try:
        # the ring gives up on its first try after ~30 s; wait for that try to fail
        line, deadline = "", time.monotonic() + 90
        while "trying again" not in line and time.monotonic() < deadline:
            line = late.stderr.readline()
            assert line or late.poll() is None, f"rank 1 ended: {late.communicate()}"
        assert "trying again" in line, "rank 1's first try did not fail within 90 s"
        first = _rank(0, hostfile, 120)
        out0, err0 = first.communicate(timeout=120)
        out1, err1 = late.communicate(timeout=120)
    finally:
        for p in (late, locals().get("first")):
            if p is not None and p.poll() is None:
                p.kill()
    assert (first.returncode, late.returncode) == (0, 0), (err0, err1)
    assert out0.split() == out1.split() == ["sum", "3.0"]


REPORT = """
import json, sys
from k3dist.model.group import report
record = {"rank": 1, "tokens": list(range(600))}
print("before", flush=True)
if sys.argv[1] == "report":
    report(record)
else:
    print(json.dumps(record), flush=True)
"""


def _writes(how: str) -> list[bytes]:
    """The writes a child makes to its stdout, each as it was made: the stdout is a
    SOCK_SEQPACKET socket, which keeps every write a message of its own."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with parent, child:
        p = subprocess.run(
            [sys.executable, "-c", REPORT, how],
            cwd=REPO,
            env={"PYTHONUNBUFFERED": "1", "PATH": "/usr/bin:/bin"},
            stdout=child.fileno(),
            timeout=60,
        )
        assert p.returncode == 0
        child.close()
        parent.settimeout(5)
        writes = []
        while chunk := parent.recv(1 << 16):
            writes.append(chunk)
    return writes


def test_a_rank_report_is_one_write_even_unbuffered():
    # print() under PYTHONUNBUFFERED (as some CI images set it) writes the text and its
    # newline apart: mlx.launch, relaying 4 ranks, once put another rank's line between.
    line = _writes("report")[-1]
    assert _writes("print")[-2:] == [line[:-1], b"\n"]
    assert line.startswith(b'{"rank"') and line.endswith(b"]}\n")
    assert json.loads(line)["tokens"] == list(range(600))
