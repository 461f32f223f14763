"""A training run's loss curve: ``read_log`` and ``plot_log`` (the run's log.jsonl drawn
with matplotlib)."""

from __future__ import annotations

import json
from pathlib import Path

from k3dist.factory import corpus

import numpy as np

# ----------------------------------------------------------------------------- curve


def read_log(path: str | Path) -> tuple[list[dict], list[dict]]:
    """(step records, event records) of a run's log.jsonl."""
    steps, events = [], []
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        (events if "event" in r else steps).append(r)
    return steps, events


def plot_log(log: str | Path, png: str | Path, smooth: int = 20) -> Path:
    """Training curve: train loss (raw and running mean) and held-out NLL per domain
    against tokens seen; the MXFP4 freeze marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, events = read_log(log)
    if not steps:
        raise ValueError(f"{log}: no training steps logged yet")
    tok = np.array([r["tokens"] for r in steps]) / 1e6
    loss = np.array([r["loss"] for r in steps])
    k = max(1, min(smooth, len(loss)))
    mean = np.convolve(loss, np.ones(k) / k, mode="valid")
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    ax.plot(tok, loss, color="0.8", lw=0.8, label="train loss (batch)")
    ax.plot(tok[k - 1 :], mean, color="C0", lw=1.5, label=f"train loss (mean of {k})")
    for i, dom in enumerate(corpus.DOMAINS):
        pts = [(r["tokens"] / 1e6, r["eval"][dom]) for r in steps if "eval" in r]
        if pts:
            ax.plot(
                *zip(*pts, strict=True), "o-", ms=3, color=f"C{i + 1}", label=f"held-out {dom} NLL"
            )
    for e in events:
        if e["event"] == "freeze":
            at = next((r["tokens"] for r in steps if r["step"] == e["step"]), None)
            if at is not None:
                ax.axvline(at / 1e6, color="k", ls="--", lw=0.8)
                ax.text(at / 1e6, ax.get_ylim()[1], " experts -> MXFP4", va="top", fontsize=8)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("nats / token")
    ax.set_title(f"mini-K3 ({steps[-1]['step']} steps)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return Path(png)
