"""Quality of student builds against the MXFP4 teacher build, over fixed held-out windows.

For every domain of the shipped corpus (``k3dist.factory.corpus.DOMAINS``) the first
``--windows`` non-overlapping ``--seq``-token windows of the held-out (``eval``) split are
run through the teacher once per window; each student then runs the same window and is
compared on it, token by token:

- mean KL(teacher || student) per token (nats), from float32 log-softmaxes;
- top-1 flip rate: the share of tokens whose argmax differs from the teacher's;
- student perplexity (exp of the mean next-token NLL) per domain.

Memory is bounded by one window's logits (teacher and one student: 2 x seq x vocab x 4
bytes) plus the models; nothing is kept across windows but running sums. Every student is
loaded once (the mini-K3 is 12M parameters); the real K3 needs the streamed block-by-block
teacher of issue 12 point 1 (not built here) and one student at a time with the teacher's
per-window top-k saved, not this in-process loop.

Per student: expert bytes (every routed-expert tensor of its files: codes, scales,
biases, both banks, a fallback copy included) and expert bits per weight (those bytes
over the routed expert parameters, each counted once); for a graded student the measured
``k_hi`` drop rate (routes past ``k_hi`` that had no lo-bank fallback, over all routes;
``k3dist.serve.banks``). Float32 activations on CPU; deterministic across re-runs.

    python -m k3dist.bench.evaluate --teacher runs/mini-build \\
        --student runs/quality/2bit-g32 --student runs/quality/graded-10-frequency \\
        --windows 8 --out quality.json --markdown quality.md --plot quality.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from k3dist.build.checkpoint import INDEX_NAME
from k3dist.factory import corpus, quality, train
from k3dist.format import layout
from k3dist.format.graded import GRADED_KEY, GradedMap, bank_of
from k3dist.format.sfile import CheckpointError, read_header
from k3dist.serve import banks

import mlx.core as mx
import mlx.nn as nn
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
            f"{index}: missing; evaluate a k3dist build (python -m k3dist.convert)"
        )
    config = json.loads((build / "config.json").read_text())
    tc = layout.text_config(config)
    E = tc["num_experts"]
    quant = config.get("quantization", {})
    files = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
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


def load(path: str | Path) -> tuple[nn.Module, GradedMap | None]:
    """A build in one process, float32, eval mode: (model, graded map or None)."""
    config = json.loads((Path(path) / "config.json").read_text())
    if GRADED_KEY in config:
        model, _ = banks.load_build(path, "float32")
        model.eval()
        return model, GradedMap.from_config(config)
    return quality.load_teacher(path), None


def build_name(path: str | Path) -> str:
    """``mxfp4``, ``2bit-g32`` (uniform: a graded build with nothing promoted) or
    ``graded-<percent>`` (promoted share of the routed experts, rounded)."""
    config = json.loads((Path(path) / "config.json").read_text())
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
    """Running per-domain sums (float64 on the host): nothing per token is kept."""

    kl: float = 0.0
    flips: int = 0
    nll: float = 0.0
    tokens: int = 0

    def add(self, kl: float, flips: int, nll: float, tokens: int) -> None:
        self.kl += kl
        self.flips += flips
        self.nll += nll
        self.tokens += tokens


def _log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def compare(t_logp: mx.array, s_logits: mx.array, y: mx.array) -> tuple[float, int, float]:
    """Summed KL(teacher || student), top-1 flips and student NLL over one window."""
    s_logp = _log_softmax(s_logits)
    kl = (mx.exp(t_logp) * (t_logp - s_logp)).sum(axis=-1)
    flips = (mx.argmax(t_logp, axis=-1) != mx.argmax(s_logp, axis=-1)).sum()
    nll = -mx.take_along_axis(s_logp, y[..., None], axis=-1).sum()
    mx.eval(kl, flips, nll)
    return float(np.asarray(kl, dtype=np.float64).sum()), int(flips.item()), float(nll.item())


@dataclass
class Student:
    path: Path
    model: nn.Module
    gmap: GradedMap | None
    sums: dict[str, Sums] = field(default_factory=dict)


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
) -> dict:
    """The quality report (the issue's schema): ``{"teacher", "rows": [...]}``. Windows
    are the shipped corpus's held-out split encoded with ``tokenizer_dir`` (default: the
    teacher build's own tokenizer)."""
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
    t_model, t_gmap = load(teacher)
    if t_gmap is not None:
        raise ValueError(f"{teacher}: the teacher must be the MXFP4 build, not a graded one")
    studs = []
    for p in students:
        model, gmap = load(p)
        if gmap is not None:
            model.count_routes(True)
        studs.append(Student(Path(p), model, gmap))
    for m in (t_model, *(s.model for s in studs)):
        train.reset_caches(m)
    teacher_nll: dict[str, Sums] = {}
    for dom in corpus.DOMAINS:
        x, y = quality.windows(SPLIT, dom, seq, windows, corpus_dir, tokenizer_dir)
        teacher_nll[dom] = Sums()
        for s in studs:
            s.sums[dom] = Sums()
        for w in range(x.shape[0]):
            xw, yw = x[w : w + 1], y[w : w + 1]
            t_logp = _log_softmax(t_model(xw))
            mx.eval(t_logp)
            nll = -mx.take_along_axis(t_logp, yw[..., None], axis=-1).sum().item()
            teacher_nll[dom].add(0.0, 0, nll, yw.size)
            for s in studs:
                s.sums[dom].add(*compare(t_logp, s.model(xw), yw), yw.size)
            del t_logp
        say(f"{dom}: {x.shape[0]} windows x {seq} tokens")
    t_bytes = expert_bytes(teacher)

    def ppl(sums: Sums) -> float:
        return round(math.exp(sums.nll / sums.tokens), 4)

    rows = []
    for s, score, name in zip(studs, scores, names, strict=True):
        eb = expert_bytes(s.path)
        tok = sum(v.tokens for v in s.sums.values())
        row = {
            "build": name or build_name(s.path),
            "path": _rel(s.path),
            "score": score,
            "kl": round(sum(v.kl for v in s.sums.values()) / tok, 6),
            "flip": round(sum(v.flips for v in s.sums.values()) / tok, 6),
            "ppl": {d: ppl(v) for d, v in s.sums.items()},
            "kl_by_domain": {d: round(v.kl / v.tokens, 6) for d, v in s.sums.items()},
            "flip_by_domain": {d: round(v.flips / v.tokens, 6) for d, v in s.sums.items()},
            "expert_bpw": round(eb.bpw, 4),
            "bytes": eb.bytes,
            "k_hi_drop_rate": None,
        }
        if s.gmap is not None:
            st = s.model.route_stats()
            row["k_hi_drop_rate"] = round(st["drop_rate"], 6)
            row["promoted"] = sum(len(v) for v in s.gmap.hi.values())
            row["promoted_share"] = round(
                row["promoted"] / (len(s.model.moe_layers()) * s.gmap.num_experts), 4
            )
            row["k_hi"] = sorted(set(s.gmap.k_hi.values())) if s.gmap.hi else None
            row["lo"] = s.gmap.lo
            row["overflow_token_layer_rate"] = round(st["overflow_token_layer_rate"], 6)
        rows.append(row)
    return {
        "teacher": {
            "build": _rel(Path(teacher)),
            "ppl": {d: ppl(v) for d, v in teacher_nll.items()},
            "expert_bpw": round(t_bytes.bpw, 4),
            "bytes": t_bytes.bytes,
            "expert_params": t_bytes.params,
        },
        "split": SPLIT,
        "seq": seq,
        "windows_per_domain": windows,
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
        "| build | score | expert bpw | expert bytes | KL (nats/token) | top-1 flip | "
        + " | ".join(f"{d} ppl" for d in doms)
        + " | k_hi drop rate |",
        "|---|---|---:|---:|---:|---:|" + "---:|" * len(doms) + "---:|",
        "| teacher (mxfp4) | - | "
        f"{t['expert_bpw']:.3f} | {t['bytes']:,} | 0 | 0 | "
        + " | ".join(f"{t['ppl'][d]:.3f}" for d in doms)
        + " | - |",
    ]
    for r in sorted(rep["rows"], key=lambda r: (r["bytes"], r["kl"])):
        drop = "-" if r["k_hi_drop_rate"] is None else f"{r['k_hi_drop_rate']:.4f}"
        lines.append(
            f"| {r['build']} | {r['score'] or '-'} | {r['expert_bpw']:.3f} | {r['bytes']:,} | "
            f"{r['kl']:.5f} | {r['flip']:.4f} | "
            + " | ".join(f"{r['ppl'][d]:.3f}" for d in doms)
            + f" | {drop} |"
        )
    return "\n".join(lines) + "\n"


def plot(rep: dict, path: str | Path) -> Path:
    """KL vs expert bits per weight, one point per row, labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {"frequency": "tab:blue", "random": "tab:orange", None: "black"}
    uniform = sorted((r["expert_bpw"], r["kl"]) for r in rep["rows"] if r["score"] is None)
    if len(uniform) > 1:
        ax.plot(*zip(*uniform, strict=True), color="gray", ls="--", lw=0.8, zorder=0)
    labelled = set()
    for r in rep["rows"]:
        score = r["score"]
        ax.scatter(
            r["expert_bpw"],
            r["kl"],
            color=colors.get(score, "tab:green"),
            label=None if score in labelled else (score or "uniform"),
            s=18,
        )
        labelled.add(score)
        if r["build"] not in labelled:  # one label per build, at its first point
            labelled.add(r["build"])
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
    ap.add_argument("--teacher", required=True, type=Path, help="MXFP4 build (k3dist.convert)")
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
