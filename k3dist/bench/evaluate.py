"""Quality of student builds against the MXFP4 teacher build, over fixed held-out windows.

For every domain of the shipped corpus (``k3dist.factory.corpus.DOMAINS``) the first
``--windows`` non-overlapping ``--seq``-token windows of the held-out (``eval``) split are
run through the teacher once per window; each student then runs the same window and is
compared on it, token by token:

- mean KL(teacher || student) per token (nats), from float32 log-softmaxes, and its
  95th percentile over the tokens (``kl_p95``; the tail a mean hides: llama.cpp's KL
  tables report the same), overall and per domain;
- top-1 flip rate: the share of tokens whose argmax differs from the teacher's;
- student perplexity (exp of the mean next-token NLL) per domain.

Memory is bounded by one window's logits (teacher and one student: 2 x seq x vocab x 4
bytes) plus the models; nothing is kept across windows but running sums and one float32
KL per token (for the percentile). Every student is
loaded once (the mini-K3 is 12M parameters); the real K3 needs the streamed block-by-block
teacher of issue 12 point 1 (not built here) and one student at a time with the teacher's
per-window top-k saved, not this in-process loop.

Per student: expert bytes (every routed-expert tensor of its files: codes, scales,
biases, both banks, a fallback copy included) and expert bits per weight (those bytes
over the routed expert parameters, each counted once); for a graded student the measured
``k_hi`` drop rate (routes past ``k_hi`` that had no lo-bank fallback, over all routes;
``k3dist.model.two_bank``). Float32 activations on CPU; deterministic across re-runs.

    python -m k3dist.bench.evaluate --teacher runs/mini-build \\
        --student runs/quality/2bit-g32 --student runs/quality/graded-10-frequency \\
        --windows 8 --out quality.json --markdown quality.md --plot quality.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from k3dist.factory import corpus
from k3dist.factory.windows import token_set
from k3dist.format import layout
from k3dist.format.folder import INDEX_NAME, load_config, weight_map
from k3dist.format.graded import GRADED_KEY, GradedMap, bank_of
from k3dist.format.kvmemory import GiB
from k3dist.format.sfile import CheckpointError, read_header
from k3dist.pipeline import stream
from k3dist.pipeline import teacher as teacher_mod
from k3dist.pipeline.teacher import log_softmax

import mlx.core as mx
import numpy as np

SPLIT = "eval"  # the held-out split


# ----------------------------------------------------------------------------- builds


@dataclass
class ExpertBytes:
    bytes: int  # every routed-expert tensor (codes, scales, biases; both banks)
    params: int  # routed expert weights, each expert counted once

    @property
    def bpw(self) -> float:
        return 8 * self.bytes / self.params


def expert_bytes(build: str | Path) -> ExpertBytes:
    """Routed-expert bytes and parameters of a build, from its files and config."""
    build = Path(build)
    index = build / INDEX_NAME
    if not index.exists():
        raise CheckpointError(
            f"{index}: missing; evaluate a k3dist build (python -m k3dist.pipeline.convert)"
        )
    config = load_config(build)
    tc = layout.text_config(config)
    E = tc["num_experts"]
    quant = config.get("quantization", {})
    files = dict.fromkeys(weight_map(build).values())
    nbytes, params = 0, {}
    for f in files:
        for name, t in read_header(build / f).tensors.items():
            b = bank_of(name)
            if b is None:
                continue
            nbytes += t.nbytes
            if not name.endswith(".weight"):
                continue
            module = name.rsplit(".", 1)[0]
            q = quant.get(module, quant)
            bits = q.get("bits") if t.dtype == "U32" else None
            if t.dtype == "U32" and not bits:
                raise CheckpointError(f"{build}/config.json: no quantization for {module!r}")
            cols = t.shape[-1] * 32 // bits if bits else t.shape[-1]
            proj = name.split(f".{b[1]}.")[1].split(".")[0]
            params[(b[0], proj)] = E * math.prod(t.shape[1:-1]) * cols
    if not params:
        raise CheckpointError(f"{build}: no routed-expert tensors (mlp.switch_mlp / switch_hi)")
    return ExpertBytes(nbytes, sum(params.values()))


def build_name(path: str | Path) -> str:
    """``mxfp4``, ``2bit-g32`` (uniform: a graded build with nothing promoted) or
    ``graded-<percent>`` (promoted share of the routed experts, rounded)."""
    config = load_config(path)
    gmap = GradedMap.from_config(config)
    if gmap is None:
        return "mxfp4"
    promoted = sum(len(v) for v in gmap.hi.values())
    if not promoted:
        return gmap.lo
    moe = len(layout.moe_layers(layout.text_config(config)))
    return f"graded-{round(100 * promoted / (moe * gmap.num_experts))}"


# ----------------------------------------------------------------------------- metrics


@dataclass
class Sums:
    """Running per-domain sums (float64 on the host) and the per-token KLs (float32,
    for the percentile)."""

    kl: float = 0.0
    flips: int = 0
    nll: float = 0.0
    tokens: int = 0
    kl_tokens: list[np.ndarray] = field(default_factory=list)

    def add(
        self, kl: float, flips: int, nll: float, tokens: int, kl_tokens: np.ndarray | None = None
    ) -> None:
        self.kl += kl
        self.flips += flips
        self.nll += nll
        self.tokens += tokens
        if kl_tokens is not None:
            self.kl_tokens.append(np.asarray(kl_tokens, dtype=np.float32))


def kl_percentile(sums: list[Sums], q: float = 95.0) -> float:
    """The ``q``-th percentile of the per-token KLs over ``sums`` (linear interpolation,
    numpy's default)."""
    kls = [k for s in sums for k in s.kl_tokens]
    if not kls:
        raise ValueError("no per-token KLs recorded")
    return float(np.percentile(np.concatenate(kls), q))


def row_sums(
    t_ids: mx.array | None, t_logp: mx.array, s_logits: mx.array, y: mx.array
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per window of a batch: summed KL(teacher || student), top-1 flips and student
    NLL, and the per-token KLs ([windows, seq]). A top-k teacher (``t_ids``) compares
    on its k entries plus one bucket for the rest of the vocabulary on each side (exact
    when k is the vocabulary)."""
    s_logp = log_softmax(s_logits)
    if t_ids is None:
        kl = (mx.exp(t_logp) * (t_logp - s_logp)).sum(axis=-1)
        t_top = mx.argmax(t_logp, axis=-1)
    else:
        s_top = mx.take_along_axis(s_logp, t_ids, axis=-1)
        p = mx.exp(t_logp)
        tail_p = mx.maximum(1.0 - p.sum(-1), 1e-12)
        tail_q = mx.maximum(1.0 - mx.exp(s_top).sum(-1), 1e-12)
        kl = (p * (t_logp - s_top)).sum(-1) + tail_p * (mx.log(tail_p) - mx.log(tail_q))
        t_top = mx.take_along_axis(t_ids, mx.argmax(t_logp, axis=-1)[..., None], axis=-1)[..., 0]
    flips = (t_top != mx.argmax(s_logp, axis=-1)).sum(axis=-1)
    nll = -mx.take_along_axis(s_logp, y[..., None], axis=-1)[..., 0].sum(axis=-1)
    kl_tok = kl
    kl = kl.sum(axis=-1)
    mx.eval(kl, flips, nll, kl_tok)
    return (
        np.asarray(kl, dtype=np.float64),
        np.asarray(flips),
        np.asarray(nll, dtype=np.float64),
        np.asarray(kl_tok, dtype=np.float32),
    )


def _ppl(sums: Sums) -> float:
    return round(math.exp(sums.nll / sums.tokens), 4)


def _row(path: Path, gmap, sums: dict, st: dict | None, stm, score, name) -> dict:
    """One student's row of the report: KL, flips and perplexity overall and by domain,
    its expert bytes, and (graded) its promotion and k_hi figures."""
    eb = expert_bytes(path)
    tok = sum(v.tokens for v in sums.values())
    row = {
        "build": name or build_name(path),
        "path": _rel(path),
        "score": score,
        "kl": round(sum(v.kl for v in sums.values()) / tok, 6),
        "kl_p95": round(kl_percentile(list(sums.values())), 6),
        "flip": round(sum(v.flips for v in sums.values()) / tok, 6),
        "ppl": {d: _ppl(v) for d, v in sums.items()},
        "kl_by_domain": {d: round(v.kl / v.tokens, 6) for d, v in sums.items()},
        "kl_p95_by_domain": {d: round(kl_percentile([v]), 6) for d, v in sums.items()},
        "flip_by_domain": {d: round(v.flips / v.tokens, 6) for d, v in sums.items()},
        "expert_bpw": round(eb.bpw, 4),
        "bytes": eb.bytes,
        "k_hi_drop_rate": None,
    }
    if gmap is not None:
        row["k_hi_drop_rate"] = round(st["drop_rate"], 6)
        row["promoted"] = sum(len(v) for v in gmap.hi.values())
        row["promoted_share"] = round(
            row["promoted"] / (len(stm.model.moe_layers()) * gmap.num_experts), 4
        )
        row["k_hi"] = sorted(set(gmap.k_hi.values())) if gmap.hi else None
        row["lo"] = gmap.lo
        row["overflow_token_layer_rate"] = round(st["overflow_token_layer_rate"], 6)
    return row


def evaluate(
    teacher: str | Path,
    students: list[str | Path],
    windows: int,
    seq: int = 256,
    scores: list[str | None] | None = None,
    names: list[str | None] | None = None,
    corpus_dir: Path = corpus.CORPUS_DIR,
    tokenizer_dir: Path | None = None,
    progress: bool = True,
    batch: int = 4,
    cap: int = 2 * GiB,
    top_k: int = 0,
    work: str | Path | None = None,
) -> dict:
    """The quality report (the issue's schema): ``{"teacher", "rows": [...]}``. Windows
    are the shipped corpus's held-out split encoded with ``tokenizer_dir`` (default: the
    teacher build's own tokenizer). The teacher runs once through the streamed teacher
    (``k3dist.pipeline.teacher``: log-probabilities to ``work``, a temporary folder unless
    given; ``top_k`` 0 keeps the whole vocabulary), then each student streams the same
    windows a layer at a time and is compared batch by batch."""
    tokenizer_dir = Path(teacher) if tokenizer_dir is None else tokenizer_dir
    t0 = time.perf_counter()

    def say(what: str) -> None:
        if progress:
            print(f"[{time.perf_counter() - t0:7.1f} s] {what}", file=sys.stderr, flush=True)

    scores = scores or [None] * len(students)
    names = names or [None] * len(students)
    if not len(scores) == len(names) == len(students):
        raise ValueError(
            f"{len(scores)} scores, {len(names)} names for {len(students)} students; one each"
        )
    if GRADED_KEY in load_config(teacher):
        raise ValueError(f"{teacher}: the teacher must be the MXFP4 build, not a graded one")
    tokens, targets, doms = token_set(SPLIT, seq, windows, corpus_dir, tokenizer_dir)
    rows_of = stream.batches(len(tokens), batch)
    with tempfile.TemporaryDirectory(prefix="k3dist-eval-") as tmp:
        t_dir = teacher_mod.run(
            teacher,
            tokens,
            Path(work or tmp) / "teacher",
            cap=cap,
            batch=batch,
            top_k=top_k,
            targets=targets,
            progress=False,
        )
        t_out = teacher_mod.TeacherOutput(t_dir)
        say(f"teacher: {len(tokens)} windows x {seq} tokens")
        teacher_nll = {d: Sums() for d in corpus.DOMAINS}
        for b, r in enumerate(rows_of):
            nll = -np.asarray(t_out.target_logp(b).sum(axis=-1), dtype=np.float64)
            for j, w in enumerate(range(r.start, r.stop)):
                teacher_nll[doms[w]].add(0.0, 0, float(nll[j]), seq)
        studs = []
        for p in students:
            st = stream.LayerStream(p)
            gmap = GradedMap.from_config(st.config)
            if gmap is not None:
                st.model.count_routes(True)
            sums = {d: Sums() for d in corpus.DOMAINS}
            for b, (r, logits) in enumerate(stream.forward(st, tokens, batch=batch, cap=cap)):
                ids, t_logp = t_out.logits(b)
                kl, flips, nll, kl_tok = row_sums(ids, t_logp, logits, mx.array(targets[r]))
                for j, w in enumerate(range(r.start, r.stop)):
                    sums[doms[w]].add(float(kl[j]), int(flips[j]), float(nll[j]), seq, kl_tok[j])
            stats = st.model.route_stats() if gmap is not None else None
            studs.append((Path(p), gmap, sums, stats, st))
            say(f"student {p}")
    t_bytes = expert_bytes(teacher)

    rows = [
        _row(path, gmap, sums, st, stm, score, name)
        for (path, gmap, sums, st, stm), score, name in zip(studs, scores, names, strict=True)
    ]
    return {
        "teacher": {
            "build": _rel(Path(teacher)),
            "ppl": {d: _ppl(v) for d, v in teacher_nll.items()},
            "expert_bpw": round(t_bytes.bpw, 4),
            "bytes": t_bytes.bytes,
            "expert_params": t_bytes.params,
            "top_k": top_k or None,
        },
        "split": SPLIT,
        "seq": seq,
        "windows_per_domain": windows,
        "batch": batch,
        "tokens_per_domain": {d: v.tokens for d, v in teacher_nll.items()},
        "rows": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _rel(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


# ----------------------------------------------------------------------------- output


def teacher_cells(t: dict, doms: list[str]) -> str:
    """The teacher's row of a quality table up to its per-domain perplexities."""
    return f"| teacher (mxfp4) | - | {t['expert_bpw']:.3f} | {t['bytes']:,} | 0 | 0 | 0 | " + (
        " | ".join(f"{t['ppl'][d]:.3f}" for d in doms)
    )


def row_cells(r: dict, doms: list[str]) -> str:
    """A build's row of a quality table up to its per-domain perplexities: build, score,
    expert bpw and bytes, mean and p95 KL, top-1 flip."""
    return (
        f"| {r['build']} | {r['score'] or '-'} | {r['expert_bpw']:.3f} | {r['bytes']:,} | "
        f"{r['kl']:.5f} | {r['kl_p95']:.5f} | {r['flip']:.4f} | "
        + " | ".join(f"{r['ppl'][d]:.3f}" for d in doms)
    )


def markdown(rep: dict) -> str:
    doms = list(rep["teacher"]["ppl"])
    t = rep["teacher"]
    lines = [
        f"Teacher `{t['build']}` (MXFP4 experts, {t['expert_bpw']:.3f} bpw, "
        f"{t['bytes']:,} expert bytes); held-out split, {rep['windows_per_domain']} windows "
        f"x {rep['seq']} tokens per domain ("
        + ", ".join(f"{d}: {n} tokens" for d, n in rep["tokens_per_domain"].items())
        + ").",
        "",
        "| build | score | expert bpw | expert bytes | KL (nats/token) | p95 KL | top-1 flip | "
        + " | ".join(f"{d} ppl" for d in doms)
        + " | k_hi drop rate |",
        "|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(doms) + "---:|",
        teacher_cells(t, doms) + " | - |",
    ]
    for r in sorted(rep["rows"], key=lambda r: (r["bytes"], r["kl"])):
        drop = "-" if r["k_hi_drop_rate"] is None else f"{r['k_hi_drop_rate']:.4f}"
        lines.append(row_cells(r, doms) + f" | {drop} |")
    return "\n".join(lines) + "\n"


def plot(rep: dict, path: str | Path) -> Path:
    """KL vs expert bits per weight, one point per row, labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    palette = {
        "frequency": "tab:blue",
        "random": "tab:orange",
        "taylor": "tab:red",
        "fisher": "tab:purple",
        "output-error": "tab:brown",
        None: "black",
    }
    uniform = sorted(
        (r["expert_bpw"], r["kl"])
        for r in rep["rows"]
        if r["score"] is None and "dwq" not in r["build"]
    )
    if len(uniform) > 1:
        ax.plot(*zip(*uniform, strict=True), color="gray", ls="--", lw=0.8, zorder=0)
    labelled = set()
    for r in rep["rows"]:
        score = r["score"]
        glob = "global" in r["build"]
        dwq = "dwq" in r["build"]
        key = (score, glob, dwq)
        label = (score or "uniform") + (" global" if glob else "") + (" + DWQ" if dwq else "")
        ax.scatter(
            r["expert_bpw"],
            r["kl"],
            color=palette.get(score, "tab:green"),
            marker="*" if dwq else ("s" if glob else "o"),
            s=60 if dwq else 18,
            label=None if key in labelled else label,
        )
        labelled.add(key)
        if r["score"] is None or dwq:
            ax.annotate(
                r["build"],
                (r["expert_bpw"], r["kl"]),
                fontsize=7,
                xytext=(4, 4),
                textcoords="offset points",
            )
    ax.legend(fontsize=8)
    ax.set_xlabel("expert bits per weight (bytes x 8 / routed expert parameters)")
    ax.set_ylabel("KL(teacher || student), nats/token")
    ax.set_yscale("log")
    ax.set_title(f"mini-K3 vs its MXFP4 teacher ({rep['teacher']['expert_bpw']:.2f} bpw), held-out")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description="KL, top-1 flip and perplexity of student "
        "builds against the MXFP4 teacher on held-out windows."
    )
    ap.add_argument(
        "--teacher",
        required=True,
        type=Path,
        help="MXFP4 build (python -m k3dist.pipeline.convert)",
    )
    ap.add_argument(
        "--student",
        action="append",
        required=True,
        type=Path,
        help="a build to compare (repeat); graded builds report the k_hi drop rate",
    )
    ap.add_argument(
        "--score",
        action="append",
        default=None,
        help="the promotion score of each --student, in order (e.g. frequency, "
        "random; '-' for none)",
    )
    ap.add_argument(
        "--name",
        action="append",
        default=None,
        help="the table name of each --student, in order (default: from its "
        "config: mxfp4, the lo format, graded-<promoted %%>)",
    )
    ap.add_argument("--windows", type=int, required=True, help="held-out windows per domain")
    ap.add_argument("--seq", type=int, default=256, help="tokens per window")
    ap.add_argument("--out", required=True, type=Path, help="JSON report")
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="PNG: KL vs expert bpw")
    a = ap.parse_args(argv)
    scores = None
    if a.score is not None:
        if len(a.score) != len(a.student):
            ap.error(f"{len(a.score)} --score for {len(a.student)} --student; one each")
        scores = [None if s == "-" else s for s in a.score]
    if a.name is not None and len(a.name) != len(a.student):
        ap.error(f"{len(a.name)} --name for {len(a.student)} --student; one each")
    try:
        rep = evaluate(a.teacher, a.student, a.windows, a.seq, scores, a.name)
    except (CheckpointError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    rep["command"] = "python -m k3dist.bench.evaluate " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    a.out.write_text(json.dumps(rep, indent=1) + "\n")
    if a.markdown:
        a.markdown.write_text(markdown(rep))
    if a.plot:
        plot(rep, a.plot)
    print(markdown(rep))


if __name__ == "__main__":
    main()
