"""Per-expert sensitivity: which routed experts lose most by going to the lo format.

The calibration token set runs through the **uniform low-bit build** (every expert in
the lo bank: the stack a graded build is made from, so the student sees at calibration
what it sees at run time), one layer at a time (``k3dist.pipeline.stream``). At every MoE
layer, for each (token t, routed expert e) pair with router weight ``w``, the expert's
lo-bank output and its MXFP4 output (the teacher build's stack, same input) give
``d = w (E_lo(x_t) - E_hi(x_t))``: what promoting ``e`` would change in the routed sum.
Scores per expert (sums over its routed tokens; higher = promote first):

- ``output-error``: ``sum ||d||^2``;
- ``fisher``: ``sum (g . d)^2`` with ``g`` the gradient of KL(teacher || student) at the
  layer's routed sum (empirical-Fisher estimate of the KL promoting ``e`` removes);
- ``taylor``: ``sum g . d``, the first-order KL decrease from promoting ``e``;
- ``frequency``: routed tokens (the baseline; also what placement uses);
- ``random``: a seeded permutation (the other baseline).

``g`` comes from a streamed backward pass: the forward saves the student's state at each
AttnRes block input (to ``--work``, on disk), the KL to the teacher's log-probabilities
(``k3dist.pipeline.teacher``) gives the cotangent at the end, and the blocks run backward
one at a time: the layer inputs of the block are recomputed from its saved input, then
each layer's ``mx.vjp`` runs alone, a zero probe added to each MoE layer's routed sum
reading ``g``. Memory: two state sets (states + cotangents,
``k3dist.pipeline.stream.check_cap`` with 2 copies), one student layer and one teacher
expert stack, and one batch's layer backward: for a KDA layer ~4.4 recurrent states
per token (heads x head_dim^2 x 4 B: 2.3 MB per token on the ``bench`` preset, ~28 MB
on real K3, i.e. ~7 GB for a batch of one 256-token window; ``--window-batch`` sets it). On
disk: the block inputs, and one block's layer inputs while it runs backward.

The routes (top-k ids per token and MoE layer, int16) are kept too: ``k_hi`` for any
promotion set follows from them (:func:`k_hi_from_routes`).

Output folder: ``scores-<name>.npz`` (``layer_<L>`` arrays, as ``grade --scores`` reads),
``routes.npz``, ``calibrate.json`` (tokens, seconds, peak RSS, rank correlations).

    python -m k3dist.pipeline.calibrate --student runs/2bit --teacher-build runs/mxfp4 \\
        --teacher runs/teacher-calib --tokens calib.npz --out runs/calib
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from k3dist.format.graded import GradedMap
from k3dist.format.kvmemory import GiB
from k3dist.format.sfile import CheckpointError
from k3dist.pipeline import stream
from k3dist.pipeline.rss import peak_rss
from k3dist.pipeline.teacher import TeacherOutput, log_softmax, read_tokens

import mlx.core as mx
import numpy as np

SCORES = ("output-error", "fisher", "taylor", "frequency", "random")


def kl_sum(t_ids: mx.array | None, t_logp: mx.array, s_logits: mx.array) -> mx.array:
    """Summed KL(teacher || student) over tokens; with top-k teacher ids the rest of the
    vocabulary is one bucket on each side (exact when k is the vocabulary)."""
    s_logp = log_softmax(s_logits)
    if t_ids is None:
        return (mx.exp(t_logp) * (t_logp - s_logp)).sum()
    s_top = mx.take_along_axis(s_logp, t_ids, axis=-1)
    p = mx.exp(t_logp)
    tail_p = mx.maximum(1.0 - p.sum(-1), 1e-12)
    tail_q = mx.maximum(1.0 - mx.exp(s_top).sum(-1), 1e-12)
    return (p * (t_logp - s_top)).sum() + (tail_p * (mx.log(tail_p) - mx.log(tail_q))).sum()


def k_hi_from_routes(
    routes: np.ndarray, promoted: list[int], top_k: int, target: float = 0.0
) -> int:
    """The smallest ``k_hi`` whose share of calibration tokens with more promoted routes
    than ``k_hi`` is at most ``target`` (0: the observed maximum)."""
    if not len(promoted):
        return 0
    hits = np.isin(routes, np.asarray(promoted)).sum(axis=-1)
    for k in range(1, top_k + 1):
        if (hits > k).mean() <= target:
            return k
    return top_k


class RoutedProbe:
    """Wraps a student MoE layer's routed path: records (latent input, ids, weights) of
    the last call and adds ``probe`` (when set) to the routed sum."""

    def __init__(self, moe):
        self.moe, self.inner = moe, moe._routed_placeholder
        self.seen: tuple[mx.array, mx.array, mx.array] | None = None
        self.probe: mx.array | None = None
        moe._routed_placeholder = self

    def __call__(self, y: mx.array, inds: mx.array, w: mx.array) -> mx.array:
        self.seen = (y, inds, w)
        out = self.inner(y, inds, w)
        return out if self.probe is None else out + self.probe


class Calibration:
    def __init__(
        self,
        student: str | Path,
        teacher_build: str | Path,
        teacher: str | Path,
        tokens: np.ndarray,
        work: str | Path,
        *,
        batch: int = 4,
        cap: int = 2 * GiB,
        seed: int = 0,
        scores: tuple[str, ...] = SCORES,
        progress: bool = True,
    ):
        self.t0 = time.perf_counter()
        self.progress = progress
        self.S = stream.LayerStream(student)
        gmap = GradedMap.from_config(self.S.config)
        if gmap is None or gmap.hi:
            raise CheckpointError(
                f"{student}: calibrate the uniform low-bit build (every expert in the lo "
                "bank: python -m k3dist.pipeline.promote --per-layer 0), not "
                + ("an MXFP4 build" if gmap is None else "a graded one")
            )
        self.lo = gmap.lo
        self.T = stream.LayerStream(teacher_build)
        self.teacher = TeacherOutput(teacher)
        ident = self.teacher.manifest["identity"]
        if ident["shape"] != list(tokens.shape) or ident["batch"] != batch:
            raise CheckpointError(
                f"{teacher}: the teacher ran {ident['shape']} tokens in batches of "
                f"{ident['batch']}, this calibration {list(tokens.shape)} in {batch}; "
                "run both on the same token set and --window-batch"
            )
        self.tokens, self.batch, self.cap, self.seed = tokens, batch, cap, seed
        self.scores = scores
        stream.check_cap(self.S.tc, tokens.size, cap, copies=2, what="states + cotangents")
        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.moe = [i for i, layer in enumerate(self.S.text.layers) if hasattr(layer.mlp, "_route")]
        self.hooks = {i: RoutedProbe(self.S.text.layers[i].mlp) for i in self.moe}
        E = self.S.args.num_experts
        self.sums = {s: {i: np.zeros(E) for i in self.moe} for s in scores if s != "random"}
        self.routes: dict[int, list[np.ndarray]] = {i: [] for i in self.moe}
        size = self.S.tc.get("attn_res_block_size") or self.S.num_layers
        self.starts = list(range(0, self.S.num_layers, size))
        self.kl = 0.0
        self.grads: dict[tuple[int, int], mx.array] | None = None  # (layer, batch) -> g, if set
        self._b = 0  # the batch the backward is on

    def say(self, what: str) -> None:
        if self.progress:
            print(
                f"[{time.perf_counter() - self.t0:7.1f} s] calibrate {what}",
                file=sys.stderr,
                flush=True,
            )

    # -- per-route differences -------------------------------------------------------
    def _delta(self, i: int) -> tuple[mx.array, mx.array]:
        """(ids [B, L, k], w (E_lo - E_hi) [B, L, k, Dl]) of the last call of layer i."""
        y, inds, w = self.hooks[i].seen
        moe = self.hooks[i].moe
        lo = moe._table[inds]
        e_lo = moe.switch_mlp(y, mx.where(lo >= 0, lo, 0))
        e_hi = self.T.layer(i).mlp.switch_mlp(y, inds)
        return inds, w[..., None] * (e_lo - e_hi)

    def _add(self, name: str, i: int, inds: mx.array, values: mx.array) -> None:
        if name in self.sums:
            self.sums[name][i] += np.bincount(
                np.array(inds).reshape(-1),
                weights=np.array(values.astype(mx.float32)).reshape(-1).astype(np.float64),
                minlength=len(self.sums[name][i]),
            )

    # -- forward: output error, frequency, routes; block inputs saved --------------------
    def forward(self) -> list[mx.array]:
        """Runs the token set; returns the cotangents at the end (one per batch)."""

        def on_state(i: int, states: list[stream.State]) -> None:
            if i in self.starts or i == self.S.num_layers:
                arrays = {
                    f"{k}.{b}": a for b, s in enumerate(states) for k, a in s.arrays().items()
                }
                mx.save_safetensors(str(self.work / f"student-L{i}.safetensors"), arrays)

        def on_layer(i: int, b: int, out: stream.State) -> None:
            if i not in self.hooks:
                return
            inds, d = self._delta(i)
            mx.eval(inds, d)
            self.routes[i].append(np.array(inds).reshape(-1, inds.shape[-1]).astype(np.int16))
            self._add("frequency", i, inds, mx.ones(inds.shape))
            self._add("output-error", i, inds, (d * d).sum(-1))
            if b == len(rows) - 1:
                self.T.release_layer(i)

        rows = stream.batches(self.tokens.shape[0], self.batch)
        cots = []
        for b, (_r, logits) in enumerate(
            stream.forward(
                self.S,
                self.tokens,
                batch=self.batch,
                cap=self.cap,
                on_state=on_state,
                on_layer=on_layer,
                progress=self.say,
            )
        ):
            ids, t_logp = self.teacher.logits(b)
            self.kl += kl_sum(ids, t_logp, logits).item()
            cots.append(self._head_cotangent(b, ids, t_logp))
        return cots

    def _head_cotangent(self, b: int, ids, t_logp) -> tuple[mx.array, mx.array | None]:
        d = mx.load(str(self.work / f"student-L{self.S.num_layers}.safetensors"))
        s = stream.State.from_arrays(
            {k.split(".")[0]: v for k, v in d.items() if k.endswith(f".{b}")}
        )
        eps = self.S.args.rms_norm_eps

        def loss(h, raw):
            return kl_sum(ids, t_logp, self.S.head(stream.State(h, raw, stream.inv_rms(raw, eps))))

        if s.raw is None:
            g = mx.grad(lambda h: loss(h, None))(s.h)
            mx.eval(g)
            return g, None
        gh, graw = mx.grad(loss, argnums=(0, 1))(s.h, s.raw)
        mx.eval(gh, graw)
        return gh, graw

    # -- backward: fisher and taylor, a layer at a time ---------------------------------
    def _layer_vjp(self, i: int, s: stream.State, cot: tuple[mx.array, mx.array | None]):
        """Cotangent at layer i's input from the one at its output; at a MoE layer the
        routed-sum gradient is read by the probe and scored."""
        eps = self.S.args.rms_norm_eps
        has_raw = s.raw is not None
        moe = i in self.hooks

        def layer(*args):
            h, raw = (args[0], args[1]) if has_raw else (args[0], None)
            if moe:
                self.hooks[i].probe = args[-1]
            out = self.S.run_layer(i, stream.State(h, raw, stream.inv_rms(raw, eps)))
            return [out.h, out.raw] if out.raw is not None else [out.h]

        primals = [s.h, s.raw] if has_raw else [s.h]
        if moe:
            primals.append(mx.zeros((*s.h.shape[:-1], self._latent(i))))
        cotangents = [cot[0]] if cot[1] is None else list(cot)
        _, vjps = mx.vjp(layer, primals, cotangents)
        if moe:
            self.hooks[i].probe = None
            g = vjps[-1]
            if self.grads is not None:
                self.grads[(i, self._b)] = g
            inds, dl = self._delta(i)
            proj = (g[..., None, :] * dl).sum(-1)  # [B, L, k]
            mx.eval(inds, proj)
            self._add("fisher", i, inds, proj * proj)
            self._add("taylor", i, inds, proj)
        mx.eval(vjps)
        return vjps[0], vjps[1] if has_raw else None

    def _states(self, layer: int) -> list[stream.State]:
        d = mx.load(str(self.work / f"student-L{layer}.safetensors"))
        n = 1 + max(int(k.split(".")[1]) for k in d)
        return [
            stream.State.from_arrays(
                {k.split(".")[0]: v for k, v in d.items() if k.endswith(f".{b}")}
            )
            for b in range(n)
        ]

    def backward(self, cots: list[tuple[mx.array, mx.array | None]]) -> None:
        """Blocks in reverse. A block's layer inputs are recomputed from its saved input
        (a layer at a time, to disk), then its layers run backward a layer at a time,
        every batch through one layer before the next is read: the weights held are one
        student layer and one teacher expert stack, never a block."""
        ends = [*self.starts[1:], self.S.num_layers]
        for a, c in reversed(list(zip(self.starts, ends, strict=True))):
            states = self._states(a)
            for i in range(a, c - 1):
                for b, st in enumerate(states):
                    states[b] = self.S.run_layer(i, st)
                    mx.eval(states[b].arrays())
                arrays = {
                    f"{k}.{b}": v for b, st in enumerate(states) for k, v in st.arrays().items()
                }
                mx.save_safetensors(str(self.work / f"student-L{i + 1}.safetensors"), arrays)
                self.S.release_layer(i)
            del states
            for i in reversed(range(a, c)):
                for b, st in enumerate(self._states(i)):
                    self._b = b
                    cots[b] = self._layer_vjp(i, st, cots[b])
                self.S.release_layer(i)
                if i in self.hooks:
                    self.T.release_layer(i)
                if i != a:
                    (self.work / f"student-L{i}.safetensors").unlink()
                mx.clear_cache()
            self.say(f"backward layers {a}..{c - 1}")

    def _latent(self, i: int) -> int:
        return self.S.args.routed_expert_hidden_size or self.S.args.hidden_size

    # -- all --------------------------------------------------------------------------
    def run(self, out: str | Path) -> dict:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        cots = self.forward()
        if {"fisher", "taylor"} & set(self.scores):
            self.backward(cots)
        E = self.S.args.num_experts
        result = {name: {i: v for i, v in layers.items()} for name, layers in self.sums.items()}
        if "random" in self.scores:
            rng = np.random.default_rng(self.seed)
            result["random"] = {i: rng.permutation(E).astype(np.float64) for i in self.moe}
        for name, layers in result.items():
            _savez(out / f"scores-{name}.npz", {f"layer_{i}": v for i, v in layers.items()})
        _savez(
            out / "routes.npz", {f"layer_{i}": np.concatenate(r) for i, r in self.routes.items()}
        )
        tokens = int(self.tokens.size)
        summary = {
            "kind": "calibration",
            "student": str(self.S.path),
            "lo": self.lo,
            "teacher_build": str(self.T.path),
            "teacher": str(self.teacher.path),
            "tokens": tokens,
            "kl_per_token": round(self.kl / tokens, 6),
            "scores": sorted(result),
            "rank_correlation": _correlations(result),
            "state_bound_bytes": 2 * stream.state_bytes(self.S.tc, tokens),
            "cap": self.cap,
            "peak_rss": peak_rss(),
            "seconds": round(time.perf_counter() - self.t0, 2),
        }
        (out / "calibrate.json").write_text(json.dumps(summary, indent=1) + "\n")
        return summary


def _savez(path: Path, arrays: dict[str, np.ndarray]) -> None:
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _correlations(result: dict[str, dict[int, np.ndarray]]) -> dict[str, float]:
    """Mean Spearman correlation over layers between each pair of scores."""

    def ranks(v: np.ndarray) -> np.ndarray:
        return np.argsort(np.argsort(v)).astype(np.float64)

    names = sorted(result)
    out = {}
    for x in range(len(names)):
        for y in range(x + 1, len(names)):
            a, b = result[names[x]], result[names[y]]
            cs = [np.corrcoef(ranks(a[i]), ranks(b[i]))[0, 1] for i in a]
            out[f"{names[x]}~{names[y]}"] = round(float(np.mean(cs)), 4)
    return out


def calibrate(
    student: str | Path,
    teacher_build: str | Path,
    teacher: str | Path,
    tokens: np.ndarray,
    out: str | Path,
    **kw,
) -> dict:
    """Score every routed expert (module doc); writes ``out`` and returns the summary."""
    out = Path(out)
    work = out / "work"
    summary = Calibration(student, teacher_build, teacher, tokens, work, **kw).run(out)
    shutil.rmtree(work, ignore_errors=True)
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Per-expert sensitivity scores for graded builds.")
    ap.add_argument("--student", required=True, help="uniform low-bit build (grade --per-layer 0)")
    ap.add_argument("--teacher-build", required=True, help="the MXFP4 build")
    ap.add_argument("--teacher", required=True, help="python -m k3dist.pipeline.teacher output")
    ap.add_argument("--tokens", required=True, help="the teacher's token set (.npy/.npz)")
    ap.add_argument("--out", required=True, help="output folder")
    stream.add_window_batch(ap, 4, "windows per call")
    ap.add_argument("--cap", default="2GiB", help="memory cap for states + cotangents")
    ap.add_argument("--seed", type=int, default=0, help="the random baseline")
    ap.add_argument("--scores", default=",".join(SCORES), help="comma-separated subset")
    a = ap.parse_args(argv)
    scores = tuple(a.scores.split(","))
    bad = sorted(set(scores) - set(SCORES))
    if bad:
        ap.error(f"unknown scores {bad}; choose from {list(SCORES)}")
    try:
        s = calibrate(
            a.student,
            a.teacher_build,
            a.teacher,
            read_tokens(a.tokens),
            a.out,
            batch=a.batch,
            cap=stream.parse_bytes(a.cap),
            seed=a.seed,
            scores=scores,
        )
    except (CheckpointError, stream.StreamError) as e:
        raise SystemExit(f"error: {e}") from None
    print(json.dumps(s, indent=1))


if __name__ == "__main__":
    main()
