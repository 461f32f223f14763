"""The streamed teacher: a token set through the MXFP4 build one layer at a time.

Writes, into a journaled folder (resumable from the last saved boundary):

- ``states-L{i}.safetensors`` for every AttnRes block boundary ``i`` (the input of
  layers ``0, S, 2S, ...`` and the output of the last layer): the complete input of
  block ``i // S`` (``k3dist.pipeline.stream.State``: hidden state + block stack, float32),
  one tensor per batch of windows. Calibration starts from them; DWQ (issue 13) trains
  each student block between two of them.
- ``logits-{b}.safetensors``: the teacher's log-probabilities of batch ``b`` (float32),
  the whole vocabulary (``--top-k 0``) or its top k with their ids (real K3: 163,840
  entries per token is 640 KB; top 128 is 1 KB).
- ``k3dist.json``: what ran (build hash, tokens sha256, batch, top-k), the windows,
  seconds and the peak RSS of the run.

Memory: the states of the token set (``k3dist.pipeline.stream.check_cap`` refuses a token
set whose states exceed ``--cap``), one layer's weights, one batch's activations and
logits. Real K3: 258 KB per token of states (hidden 7168 x (8 blocks + 1) x 4 B), e.g.
1.06 GB for 16 windows of 256 tokens; on disk the 9 boundaries hold 44 hidden-state
copies per token (1.26 MB per token, 5.2 GB for those 4,096 tokens).

    python -m k3dist.pipeline.teacher --build runs/mxfp4 --tokens calib.npy --out runs/teacher
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from k3dist import __version__
from k3dist.format.journal import JournaledFolder
from k3dist.format.kvmemory import GiB
from k3dist.format.manifest import MANIFEST
from k3dist.format.sfile import CheckpointError
from k3dist.pipeline import stream
from k3dist.pipeline.rss import peak_rss

import mlx.core as mx
import numpy as np

KIND = "teacher"


def boundaries(tc: dict) -> list[int]:
    """Layer indices whose input state is saved: block starts and the end."""
    n, size = tc["num_hidden_layers"], tc.get("attn_res_block_size") or tc["num_hidden_layers"]
    return sorted({*range(0, n, size), n})


def read_tokens(path: str | Path) -> np.ndarray:
    """A token set: ``.npy`` [windows, seq] integer ids (``inputs`` of an ``.npz``)."""
    path = Path(path)
    try:
        arr = np.load(path)
        if isinstance(arr, np.lib.npyio.NpzFile):
            arr = arr["inputs"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(
            f"{path}: not a token set ({e}); give a .npy [windows, seq] of token ids "
            "or an .npz with 'inputs'"
        ) from None
    if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
        raise CheckpointError(
            f"{path}: tokens must be integer [windows, seq], not {arr.dtype} {list(arr.shape)}"
        )
    return arr.astype(np.int32)


def _save(path: Path, arrays: dict[str, mx.array]) -> dict:
    tmp = path.with_name(path.name + ".partial.safetensors")
    mx.save_safetensors(str(tmp), arrays)
    os.replace(tmp, path)
    return {"file": path.name, "bytes": path.stat().st_size}


def _save_states(path: Path, states: list[stream.State]) -> dict:
    arrays = {f"{k}.{b}": a for b, s in enumerate(states) for k, a in s.arrays().items()}
    return _save(path, arrays)


def log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def run(
    build,
    tokens: np.ndarray,
    out: str | Path,
    *,
    cap: int = 2 * GiB,
    batch: int = 4,
    top_k: int = 0,
    targets: np.ndarray | None = None,
    progress: bool = True,
) -> Path:
    """Stream ``tokens`` [N, L] through ``build`` (a folder, or a ``k3dist.pipeline.view``
    of one: the source read as its MXFP4 base build); write boundary states and logits
    to ``out`` (module doc). With ``targets`` [N, L], each batch also keeps the teacher's
    log-probability of its targets (``target_logp``: perplexity). Resumes from the last
    saved boundary."""
    out = Path(out)
    t0 = time.perf_counter()
    st = stream.LayerStream(build)
    stream.check_cap(st.tc, tokens.size, cap)
    bmf = st.build.manifest or {}
    ident = {
        "build_hash": bmf.get("build_hash"),
        "tokens_sha256": hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest(),
        "shape": list(tokens.shape),
        "batch": batch,
        "top_k": top_k,
    }
    if targets is not None:
        if targets.shape != tokens.shape:
            raise CheckpointError(f"targets {targets.shape} for tokens {tokens.shape}")
        ident["targets_sha256"] = hashlib.sha256(
            np.ascontiguousarray(targets.astype(np.int32)).tobytes()
        ).hexdigest()
    folder = JournaledFolder(out, KIND, ident)
    if folder.open():
        return out
    saved = boundaries(st.tc)
    start = None
    done = [
        i
        for i in saved
        if f"states-L{i}" in folder.done and (out / f"states-L{i}.safetensors").exists()
    ]
    if done:
        start = (done[-1], TeacherOutput(out, check=False).states(done[-1]))

    def say(what: str) -> None:
        if progress:
            print(
                f"[{time.perf_counter() - t0:7.1f} s] teacher {what}", file=sys.stderr, flush=True
            )

    def on_state(i: int, states: list[stream.State]) -> None:
        if i in saved:
            p = out / f"states-L{i}.safetensors"
            folder.unit(f"states-L{i}", lambda: _save_states(p, states))

    rows = stream.batches(tokens.shape[0], batch)
    for b, (r, logits) in enumerate(
        stream.forward(
            st, tokens, batch=batch, cap=cap, start=start, on_state=on_state, progress=say
        )
    ):
        logp = log_softmax(logits)
        if top_k:
            ids = mx.argpartition(-logp, kth=top_k - 1, axis=-1)[..., :top_k].astype(mx.int32)
            arrays = {"ids": ids, "logp": mx.take_along_axis(logp, ids, axis=-1)}
        else:
            arrays = {"logp": logp}
        if targets is not None:
            y = mx.array(targets[r].astype(np.int32))
            arrays["target_logp"] = mx.take_along_axis(logp, y[..., None], axis=-1)[..., 0]
        p = out / f"logits-{b}.safetensors"
        folder.unit(f"logits-{b}", lambda p=p, a=arrays: _save(p, a))
        assert r == rows[b]
    folder.finish(
        {
            "tool": f"k3dist {__version__}",
            "kind": KIND,
            "identity": ident,
            "build": st.build.describe,
            "boundaries": saved,
            "batches": [[r.start, r.stop] for r in rows],
            "vocab_size": st.args.vocab_size,
            "state_bytes": stream.state_bytes(st.tc, tokens.size),
            "cap": cap,
            "peak_rss": peak_rss(),
            "seconds": round(time.perf_counter() - t0, 2),
        }
    )
    return out


class TeacherOutput:
    """A finished teacher folder, read back."""

    def __init__(self, path: str | Path, check: bool = True):
        self.path = Path(path)
        if check and not (self.path / MANIFEST).exists():
            raise CheckpointError(
                f"{self.path}: not a finished teacher run (no {MANIFEST}); run "
                "python -m k3dist.pipeline.teacher (it resumes)"
            )
        self.manifest = json.loads((self.path / MANIFEST).read_text()) if check else {}

    def states(self, layer: int) -> list[stream.State]:
        p = self.path / f"states-L{layer}.safetensors"
        if not p.exists():
            raise CheckpointError(f"{p}: missing; layer {layer} is not a saved boundary")
        d = mx.load(str(p))
        n = 1 + max(int(k.split(".")[1]) for k in d)
        return [
            stream.State.from_arrays(
                {k.split(".")[0]: v for k, v in d.items() if k.endswith(f".{b}")}
            )
            for b in range(n)
        ]

    def _batch(self, b: int) -> dict[str, mx.array]:
        return mx.load(str(self.path / f"logits-{b}.safetensors"))

    def logits(self, b: int) -> tuple[mx.array | None, mx.array]:
        """(top-k ids or None for the whole vocabulary, log-probabilities) of batch ``b``."""
        d = self._batch(b)
        return d.get("ids"), d["logp"]

    def target_logp(self, b: int) -> mx.array:
        d = self._batch(b)
        if "target_logp" not in d:
            raise CheckpointError(f"{self.path}: the teacher ran without targets")
        return d["target_logp"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description="Stream a token set through an MXFP4 build one layer at a time: "
        "boundary states (calibration, DWQ) and teacher log-probabilities (evaluation)."
    )
    ap.add_argument(
        "--build", required=True, help="MXFP4 build (python -m k3dist.pipeline.convert)"
    )
    ap.add_argument("--tokens", required=True, help=".npy [windows, seq] token ids")
    ap.add_argument("--out", required=True, help="output folder (resumes if partial)")
    ap.add_argument("--cap", default="2GiB", help="memory cap for the token set's states")
    stream.add_window_batch(ap, 4, "windows per forward call")
    ap.add_argument("--top-k", type=int, default=0, help="keep the top k log-probs (0: all)")
    a = ap.parse_args(argv)
    try:
        path = run(
            a.build,
            read_tokens(a.tokens),
            a.out,
            cap=stream.parse_bytes(a.cap),
            batch=a.batch,
            top_k=a.top_k,
        )
    except (CheckpointError, stream.StreamError) as e:
        raise SystemExit(f"error: {e}") from None
    m = json.loads((path / MANIFEST).read_text())
    print(f"wrote {path} ({m['seconds']} s, peak RSS {m['peak_rss'] / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
