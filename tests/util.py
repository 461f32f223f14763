"""Shared test helpers."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_model


def load_f32(path: str | Path):
    model, config = load_model(Path(path))
    model.set_dtype(mx.float32)
    return model, config


def prompt_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    """Random ids from the base vocabulary (no control tokens)."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, vocab - 256, size=n)]


REPO = Path(__file__).resolve().parents[1]


# Ports for the servers and rings the tests start, drawn below the kernel's range for
# connections' own ports (ip_local_port_range, 32768-60999 here): a port checked free
# there stays free until its server binds it. A port from bind(0) is in that range, and
# any connection opened meanwhile (the other worker's HTTP clients, rings, watchdogs) may
# take it as its source port; a ring whose port is taken tries its bind again until
# ring_connect_s (a 2-rank launch once took 116 s that takes ~15 s).
PORT_LOW, PORT_HIGH = 10000, 31000  # P + 1000 (the watchdog) stays below 32768


def free_base_port(n: int = 4) -> int:
    """A base port P with P..P+n-1 (ring, or a server's port) and P+1000 (watchdog)
    free right now, below the ephemeral range (above), so runs in parallel (other
    worktrees, other sessions) never meet on mlx.launch's default."""
    import random
    import socket

    for _ in range(200):
        p = random.randrange(PORT_LOW, PORT_HIGH - n)
        try:
            for q in (*range(p, p + n), p + 1000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
    raise RuntimeError(f"no free port range in {PORT_LOW}..{PORT_HIGH}")


# mlx.launch (mlx 0.32) relays its stdin to every rank, and two of its loops spin a core
# while the ranks run: its main loop on a stdin at EOF (pytest's /dev/null), and each
# rank's forwarding thread on that rank's stdin pipe, which select reports writable until
# it is full or a write to it fails. So a launch here gets a stdin pipe of its own, kept
# open and written once with more than a rank's pipe holds: the main loop then waits on
# an empty pipe and each thread on a full one (or drops it at a rank that closed its
# stdin, as launch/serve.py does). None of the ranks here read their stdin.
STDIN_FILL = b"\n" * (1 << 18)


def feed_stdin(stream) -> threading.Thread:
    """Write STDIN_FILL to ``stream`` (mlx.launch's stdin) from a thread; leave it open."""

    stream = getattr(stream, "buffer", stream)  # a text-mode Popen's stdin

    def write() -> None:
        try:
            stream.write(STDIN_FILL)
            stream.flush()
        except (OSError, ValueError):  # mlx.launch already gone, or the pipe closed
            pass

    t = threading.Thread(target=write, daemon=True)
    t.start()
    return t


MLX_LAUNCH = Path(sys.executable).with_name("mlx.launch")  # this interpreter's


def launch_cmd(n: int, script: str | Path, *args: str) -> list[str]:
    """mlx.launch running ``script`` (a path, or relative to the checkout) with ``args`` on
    ``n`` ranks over loopback (ring backend), on free ports (:func:`free_base_port`)."""
    return [
        str(MLX_LAUNCH),
        "-n",
        str(n),
        "-p",
        str(free_base_port(n)),
        "--python",
        sys.executable,
        str(REPO / script),
        *args,
    ]


def mlx_launch(n: int, script: str, *args: str, timeout: float = 240):
    """Run ``script`` on ``n`` ranks over loopback (ring backend) via mlx.launch."""
    import subprocess

    cmd = launch_cmd(n, script, *args)
    # subprocess.run's communicate() would close a stdin pipe: give it our own
    r, w = os.pipe()
    try:
        proc = subprocess.Popen(
            cmd, stdin=r, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
        )
    finally:
        os.close(r)
    with open(w, "wb") as stdin, proc:
        feeder = feed_stdin(stdin)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        feeder.join(5)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def wait_file(path: Path, proc, timeout_s: float = 60.0) -> str:
    """``path``'s text once it exists (a rank writes its pid or port there); fails if
    ``proc`` (a Popen) exits first or ``timeout_s`` passes."""
    import time

    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"{path.name}: process exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s} s"
        time.sleep(0.02)
    return path.read_text()


def generate_on_ranks(rank_dir: str, tmp: Path, prompt: list[int], max_tokens: int, n: int = 2):
    """launch/generate.py on ``n`` ranks of ``rank_dir`` (a pattern with ``{rank}``):
    ``max_tokens`` greedy tokens after ``prompt``; each rank's dump (``tokens``,
    ``logits``) loaded from ``tmp/out``. Fails if a rank fails."""
    r = mlx_launch(
        n,
        "launch/generate.py",
        *("--rank-dir", rank_dir, "--prompt-ids", ",".join(map(str, prompt))),
        *("--max-tokens", str(max_tokens), "--dump", str(tmp / "out" / "rank{rank}.npz")),
    )
    assert r.returncode == 0 and not failed_ranks(r), r.stdout[-2000:] + r.stderr[-4000:]
    return [np.load(tmp / "out" / f"rank{i}.npz") for i in range(n)]


def failed_ranks(res) -> set[int]:
    """mlx.launch exits 0 even when a rank fails; it logs each failure instead."""
    import re

    text = res.stdout + res.stderr
    return {
        int(r) for r in re.findall(r"Node with rank (\d+) (?:exited with code|was killed)", text)
    }
