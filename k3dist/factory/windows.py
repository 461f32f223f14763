"""Token sets from the shipped corpus, as the streamed teacher, calibration and
evaluation read them: ``.npz`` with ``inputs`` and ``targets`` [windows, seq] (int32) and
``domain`` (one name per window). Per domain, the first ``--windows`` non-overlapping
windows of the split (``k3dist.factory.quality.windows``: deterministic).

    python -m k3dist.factory.windows --split calib --seq 256 --windows 8 --out calib.npz
"""

from __future__ import annotations

import argparse
from pathlib import Path

from k3dist.factory import corpus, quality

import numpy as np


def token_set(
    split: str,
    seq: int,
    windows: int,
    corpus_dir: Path = corpus.CORPUS_DIR,
    tokenizer_dir: Path = corpus.TOKENIZER_DIR,
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(inputs, targets) [windows x domains, seq] int32 and each window's domain."""
    xs, ys, doms = [], [], []
    for dom in corpus.DOMAINS:
        x, y = quality.windows(split, dom, seq, windows, corpus_dir, tokenizer_dir)
        xs.append(np.array(x))
        ys.append(np.array(y))
        doms += [dom] * x.shape[0]
    return np.concatenate(xs).astype(np.int32), np.concatenate(ys).astype(np.int32), doms


def export(
    split: str,
    seq: int,
    windows: int,
    out: str | Path,
    corpus_dir: Path = corpus.CORPUS_DIR,
    tokenizer_dir: Path = corpus.TOKENIZER_DIR,
) -> Path:
    inputs, targets, doms = token_set(split, seq, windows, corpus_dir, tokenizer_dir)
    out = Path(out)
    with open(out, "wb") as f:  # np.savez would append .npz to another suffix
        np.savez(
            f,
            inputs=inputs,
            targets=targets,
            domain=np.array(doms),
        )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Export corpus windows as a token set (.npz).")
    ap.add_argument("--split", choices=corpus.SPLITS, required=True)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--windows", type=int, required=True, help="windows per domain")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, default=corpus.TOKENIZER_DIR)
    a = ap.parse_args(argv)
    path = export(a.split, a.seq, a.windows, a.out, tokenizer_dir=a.tokenizer)
    n = len(np.load(path)["inputs"])
    print(f"wrote {path} ({n} windows x {a.seq} tokens)")


if __name__ == "__main__":
    main()
