"""Shared test helpers."""

from __future__ import annotations

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


def free_base_port(n: int = 4) -> int:
    """A ring base port P with P..P+n-1 (ring) and P+1000 (watchdog) free right now, so
    runs in parallel (other worktrees, other sessions) never meet on mlx.launch's default."""
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p > 60000:
            continue
        try:
            for q in (*range(p, p + n), p + 1000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port range for the ring")


def mlx_launch(n: int, script: str, *args: str, timeout: float = 240):
    """Run ``script`` on ``n`` ranks over loopback (ring backend) via mlx.launch."""
    import subprocess
    import sys

    launcher = Path(sys.executable).with_name("mlx.launch")
    cmd = [
        str(launcher),
        "-n",
        str(n),
        "-p",
        str(free_base_port(n)),
        "--python",
        sys.executable,
        str(REPO / script),
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def failed_ranks(res) -> set[int]:
    """mlx.launch exits 0 even when a rank fails; it logs each failure instead."""
    import re

    text = res.stdout + res.stderr
    return {
        int(r) for r in re.findall(r"Node with rank (\d+) (?:exited with code|was killed)", text)
    }
