"""Quality of a trained mini-K3 on the committed corpus (issue 6).

* **Held-out perplexity** per domain (``eval`` split, never trained on), beside a unigram
  model of the ``train`` split (``unigram_train``, the floor to beat): the run's float
  weights at the freeze (float32, and rounded to bf16 where K3 stores bf16), against the
  shipped MXFP4 teacher, loaded the way everything else loads it (mlx-lm's
  ``load_model`` on the Moonshot-format folder, float32 activations).
* **Routing** on the ``calib`` split: per MoE layer, the entropy of the expert load
  (uniform = log2 E bits), per domain and pooled, and how much the domains' top experts
  overlap against chance (K3's report: code and Chinese experts overlap below chance).
* **Placement**: load-aware placement fitted on the calibration counts, scored on the
  held-out routing (expected busiest-rank pairs per token; ``k3dist.format.placement``).

Windows are consecutive, non-overlapping ``seq``-token slices of each domain's documents
joined as in training (``[BOS]`` + text); each is scored from an empty state.

    python -m k3dist.factory.quality --teacher k3dist/data/mini-k3 --float runs/train \\
        --counts data/mini-k3-routing.npz --out benchmarks/results/2026-11-29/quality.json \\
        --markdown benchmarks/results/2026-11-29/quality.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

from k3dist.factory import corpus, curves, train
from k3dist.format import layout, placement
from k3dist.format import tokens as tokenizer
from k3dist.format.folder import load_config

import mlx.core as mx
import mlx.nn as nn
import numpy as np

TOP_K_OVERLAP = 8  # experts per domain compared in the overlap table


# ----------------------------------------------------------------------------- models


def load_teacher(path: str | Path) -> nn.Module:
    """A Moonshot-format checkpoint (or a k3dist build) through mlx-lm, float32."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path))
    model.set_dtype(mx.float32)
    model.eval()
    return model


def load_float(run: str | Path, bf16: bool = False) -> nn.Module:
    """A training run's float weights at the freeze (``pretrained.safetensors``);
    ``bf16``: rounded to bfloat16 wherever K3 stores bf16 (experts included)."""
    run = Path(run)
    weights = run / train.PRETRAINED_FILE
    if not weights.exists():
        raise FileNotFoundError(
            f"{weights}: no float snapshot; it is written when the run "
            "is frozen (`python train/train.py --out RUN --freeze`)"
        )
    config = load_config(run)
    model = train.build_model(config)
    model.load_weights(str(weights), strict=True)
    if bf16:
        train.round_to_source(model, config)
    mx.eval(model.parameters())
    model.eval()
    return model


# ----------------------------------------------------------------------------- data


def windows(
    split: str,
    domain: str,
    seq: int,
    max_windows: int | None = None,
    corpus_dir: Path = corpus.CORPUS_DIR,
    tokenizer_dir: Path = corpus.TOKENIZER_DIR,
) -> tuple[mx.array, mx.array]:
    """(inputs, targets) [n, seq] of one split and domain."""
    enc = tokenizer.load_encoding(tokenizer_dir)
    stream = train.token_stream(corpus.load_split(split, domain, corpus_dir), enc)
    n = (len(stream) - 1) // seq if max_windows is None else max_windows
    return train.fixed_windows(stream, seq, n)


def score(
    model: nn.Module,
    split: str = "eval",
    seq: int = 256,
    max_windows: int | None = None,
    corpus_dir: Path = corpus.CORPUS_DIR,
    tokenizer_dir: Path = corpus.TOKENIZER_DIR,
) -> tuple[dict[str, dict], dict[str, dict[int, np.ndarray]]]:
    """One pass over ``split``'s windows (all, or the first n per domain):
    ``({domain: {nll, ppl, tokens}}, {domain: {MoE layer: [tokens, top_k] expert ids}})``."""
    ppl, sel = {}, {}
    for dom in corpus.DOMAINS:
        x, y = windows(split, dom, seq, max_windows, corpus_dir, tokenizer_dir)
        with recording(model) as recs:
            nll = train.mean_nll(model, x, y)
            sel[dom] = {
                i: np.concatenate([np.array(c).reshape(-1, c.shape[-1]) for c in r.calls])
                for i, r in recs.items()
            }
        ppl[dom] = {"nll": round(nll, 5), "ppl": round(math.exp(nll), 3), "tokens": y.size}
    return ppl, sel


def perplexity(
    model: nn.Module,
    seq: int = 256,
    max_windows: int | None = None,
    split: str = "eval",
    corpus_dir: Path = corpus.CORPUS_DIR,
    tokenizer_dir: Path = corpus.TOKENIZER_DIR,
) -> dict[str, dict]:
    """{domain: {nll, ppl, tokens}} over ``split``'s windows (all, or the first n)."""
    return score(model, split, seq, max_windows, corpus_dir, tokenizer_dir)[0]


def unigram(
    seq: int = 256,
    max_windows: int | None = None,
    corpus_dir: Path = corpus.CORPUS_DIR,
    tokenizer_dir: Path = corpus.TOKENIZER_DIR,
) -> dict[str, dict]:
    """The baseline a trained model must beat: a unigram model of the ``train`` split's
    tokens (both domains, add-one smoothed over the whole vocabulary), scored on the
    same held-out windows as ``perplexity``: {domain: {nll, ppl, tokens}}."""
    enc = tokenizer.load_encoding(tokenizer_dir)
    stream = np.concatenate(
        [train.token_stream(corpus.load_split("train", d, corpus_dir), enc) for d in corpus.DOMAINS]
    )
    counts = np.bincount(stream, minlength=enc.n_vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    out = {}
    for dom in corpus.DOMAINS:
        _, y = windows("eval", dom, seq, max_windows, corpus_dir, tokenizer_dir)
        nll = float(-logp[np.array(y)].mean())
        out[dom] = {"nll": round(nll, 5), "ppl": round(math.exp(nll), 3), "tokens": y.size}
    return out


# ----------------------------------------------------------------------------- routing


class _Recorder(nn.Module):
    """Wraps a MoE layer's ``switch_mlp``; keeps the expert ids it is called with."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.calls: list[mx.array] = []

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        self.calls.append(indices)
        return self.inner(x, indices)


@contextlib.contextmanager
def recording(model: nn.Module):
    """Within: ``{layer: _Recorder}`` for every MoE layer (0-based layer index)."""
    moes = {
        i: layer.mlp for i, layer in enumerate(model.layers) if hasattr(layer.mlp, "switch_mlp")
    }
    recs = {i: _Recorder(m.switch_mlp) for i, m in moes.items()}
    for i, m in moes.items():
        m.switch_mlp = recs[i]
    try:
        yield recs
    finally:
        for i, m in moes.items():
            m.switch_mlp = recs[i].inner


def entropy_bits(counts: np.ndarray) -> float:
    p = counts / counts.sum()
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def top_experts(counts: np.ndarray, k: int) -> list[int]:
    return sorted(int(e) for e in np.argsort(-counts, kind="stable")[:k])


def window_entropy(sel: np.ndarray, seq: int, num_experts: int) -> float:
    """Mean entropy (bits) of one window's expert histogram (``seq`` tokens x top-k)."""
    per = sel.reshape(-1, seq * sel.shape[-1])
    return float(np.mean([entropy_bits(np.bincount(w, minlength=num_experts)) for w in per]))


def iid_window_entropy(load: np.ndarray, draws: int, trials: int = 200, seed: int = 0) -> float:
    """The same, had each window's ``draws`` assignments come independently from ``load``
    (what routing that ignores context would give)."""
    rng = np.random.default_rng(seed)
    hists = rng.multinomial(draws, load / load.sum(), size=trials)
    return float(np.mean([entropy_bits(h) for h in hists]))


def routing_report(
    sel: dict[str, dict[int, np.ndarray]], num_experts: int, seq: int, k: int = TOP_K_OVERLAP
) -> dict:
    """Per MoE layer: load entropy (pooled and per domain) and the mutual information
    of domain and expert; the mean entropy within a ``seq``-token window against iid
    draws from the pooled load; busiest expert over the mean; the domains' top-``k``
    experts, the share of their domain's load they carry, and their overlap (chance
    k*k/E)."""
    doms = list(sel)
    layers = sorted(next(iter(sel.values())))
    rows = []
    for layer in layers:
        c = {d: np.bincount(sel[d][layer].ravel(), minlength=num_experts) for d in doms}
        pooled = sum(c.values())
        n = sum(int(v.sum()) for v in c.values())
        h_cond = sum(int(c[d].sum()) / n * entropy_bits(c[d]) for d in doms)
        top_k = next(iter(sel.values()))[layer].shape[-1]
        tops = {d: top_experts(c[d], k) for d in doms}
        row = {
            "layer": layer,
            "entropy_bits": round(entropy_bits(pooled), 3),
            "domain_entropy_bits": {d: round(entropy_bits(c[d]), 3) for d in doms},
            "domain_mutual_info_bits": round(entropy_bits(pooled) - h_cond, 4),
            "window_entropy_bits": {
                d: round(window_entropy(sel[d][layer], seq, num_experts), 3) for d in doms
            },
            "window_entropy_iid_bits": round(iid_window_entropy(pooled, seq * top_k), 3),
            "max_over_mean": round(float(pooled.max() / pooled.mean()), 2),
            "unused_experts": int((pooled == 0).sum()),
            "top_experts": tops,
            "top_share": {d: round(float(c[d][tops[d]].sum() / c[d].sum()), 3) for d in doms},
        }
        if len(doms) == 2:
            row["top_overlap"] = len(set(tops[doms[0]]) & set(tops[doms[1]]))
        rows.append(row)
    return {
        "uniform_bits": round(math.log2(num_experts), 3),
        "top_k": k,
        "uniform_top_share": round(k / num_experts, 3),
        "overlap_chance": round(k * k / num_experts, 3),
        "layers": rows,
    }


def counts_of(sel: dict[str, dict[int, np.ndarray]], num_experts: int) -> dict[int, np.ndarray]:
    """Pooled per-expert routing counts per MoE layer (``placement.read_counts``'s shape)."""
    layers = next(iter(sel.values()))
    return {
        layer: sum(np.bincount(s[layer].ravel(), minlength=num_experts) for s in sel.values())
        for layer in layers
    }


def placement_report(
    calib: dict[int, np.ndarray],
    held_out: dict[int, np.ndarray],
    num_experts: int,
    sizes: tuple[int, ...] = (2, 4),
) -> dict:
    """Expected busiest-rank pairs per token on held-out routing: contiguous vs a
    load-aware placement fitted on the calibration counts (and the ideal top_k/size)."""
    out = {}
    top_k = next(iter(held_out.values())).shape[-1]
    for size in sizes:
        cont = placement.contiguous(num_experts, size, list(held_out))
        aware = placement.load_aware(calib, size)
        out[str(size)] = {
            "contiguous": round(
                float(np.mean([cont.expected_max_load(i, s) for i, s in held_out.items()])), 3
            ),
            "load_aware": round(
                float(np.mean([aware.expected_max_load(i, s) for i, s in held_out.items()])), 3
            ),
            "ideal": round(math.ceil(top_k / size), 3),
        }
    return out


def write_counts(counts: dict[int, np.ndarray], path: str | Path) -> Path:
    """``.npz`` of ``layer_L`` arrays: a deployment's ``placement_counts``."""
    np.savez(path, **{f"layer_{k}": v.astype(np.int64) for k, v in counts.items()})
    return Path(path)


# ----------------------------------------------------------------------------- report


def report(
    teacher: str | Path,
    run: str | Path | None,
    seq: int = 256,
    max_windows: int | None = None,
    counts_out: str | Path | None = None,
    progress: bool = True,
) -> dict:
    t0 = time.perf_counter()

    def say(what: str) -> None:
        if progress:
            print(f"[{time.perf_counter() - t0:7.1f} s] {what}", file=sys.stderr, flush=True)

    model = load_teacher(teacher)
    config = load_config(teacher)
    e = layout.text_config(config)["num_experts"]
    say("teacher: held-out split")
    ppl, held = score(model, "eval", seq, max_windows)
    out: dict = {
        "teacher": str(teacher),
        "seq": seq,
        "max_windows": max_windows,
        "perplexity": {"mxfp4_teacher": ppl, "unigram_train": unigram(seq, max_windows)},
    }
    say("teacher: calibration split")
    calib_ppl, calib = score(model, "calib", seq, max_windows)
    out["calib_perplexity"] = calib_ppl
    out["routing_calib"] = routing_report(calib, e, seq)
    calib_counts = counts_of(calib, e)
    held_pooled = {i: np.concatenate([held[d][i] for d in corpus.DOMAINS]) for i in calib_counts}
    out["placement_held_out"] = placement_report(calib_counts, held_pooled, e)
    # A deployment that serves one domain: fitted on that domain's calibration routing.
    out["placement_held_out_by_domain"] = {
        d: placement_report(counts_of({d: calib[d]}, e), held[d], e) for d in corpus.DOMAINS
    }
    if counts_out is not None:
        out["counts"] = str(write_counts(calib_counts, counts_out))
    if run is not None:
        for name, bf16 in (("float32", False), ("bf16", True)):
            say(f"{name} weights at the freeze: held-out split")
            out["perplexity"][name] = perplexity(load_float(run, bf16), seq, max_windows)
        steps, events = curves.read_log(Path(run) / "log.jsonl")
        freeze = next((ev for ev in events if ev["event"] == "freeze"), None)
        out["run"] = {
            "steps": steps[-1]["step"] if steps else 0,
            "tokens": steps[-1]["tokens"] if steps else 0,
            "freeze": freeze,
        }
    out["seconds"] = round(time.perf_counter() - t0, 1)
    say("done")
    return out


def markdown(rep: dict) -> str:
    """The report's tables (perplexity, routing, placement) as Markdown."""
    doms = corpus.DOMAINS
    ppl = rep["perplexity"]
    lines = [
        "| model | " + " | ".join(f"{d} ppl (nll)" for d in doms) + " |",
        "|---|" + "---:|" * len(doms),
    ]
    for name, row in ppl.items():
        lines.append(
            f"| {name} | "
            + " | ".join(f"{row[d]['ppl']:.2f} ({row[d]['nll']:.4f})" for d in doms)
            + " |"
        )
    r = rep["routing_calib"]
    lines += [
        "",
        f"| MoE layer | load entropy, bits (uniform {r['uniform_bits']}) | "
        + " | ".join(f"{d} entropy" for d in doms)
        + " | I(domain; expert), bits | "
        + " | ".join(f"{d} window entropy" for d in doms)
        + " | window entropy if iid | busiest / mean | "
        + " | ".join(f"{d} top-{r['top_k']} share" for d in doms)
        + f" | top-{r['top_k']} overlap (chance {r['overlap_chance']}) |",
        "|---:|---:|" + "---:|" * (2 * len(doms) + 3 + len(doms)) + "---:|",
    ]
    for row in r["layers"]:
        lines.append(
            f"| {row['layer']} | {row['entropy_bits']:.3f} | "
            + " | ".join(f"{row['domain_entropy_bits'][d]:.3f}" for d in doms)
            + f" | {row['domain_mutual_info_bits']:.3f} | "
            + " | ".join(f"{row['window_entropy_bits'][d]:.3f}" for d in doms)
            + f" | {row['window_entropy_iid_bits']:.3f} | {row['max_over_mean']:.2f} | "
            + " | ".join(f"{row['top_share'][d]:.3f}" for d in doms)
            + f" | {row.get('top_overlap', '-')} |"
        )
    lines += [
        "",
        "| traffic | ranks | contiguous | load-aware (fit on calib) | ideal |",
        "|---|---:|---:|---:|---:|",
    ]
    by = {"pooled": rep["placement_held_out"], **rep.get("placement_held_out_by_domain", {})}
    for traffic, sizes in by.items():
        for size, v in sizes.items():
            lines.append(
                f"| {traffic} | {size} | {v['contiguous']:.3f} | "
                f"{v['load_aware']:.3f} | {v['ideal']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description="Held-out perplexity and routing statistics of a trained mini-K3."
    )
    ap.add_argument(
        "--teacher",
        type=Path,
        default=Path("k3dist/data/mini-k3"),
        help="MXFP4 checkpoint (Moonshot format or a build)",
    )
    ap.add_argument(
        "--float",
        dest="run",
        type=Path,
        default=None,
        help="training run folder: also score its float weights",
    )
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--max-windows", type=int, default=None, help="per domain (default all)")
    ap.add_argument(
        "--counts",
        type=Path,
        default=None,
        help="write calibration routing counts (.npz, placement_counts)",
    )
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the tables here")
    a = ap.parse_args(argv)
    rep = report(a.teacher, a.run, a.seq, a.max_windows, a.counts)
    rep["command"] = "python -m k3dist.factory.quality " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    text = json.dumps(rep, indent=1)
    if a.out is not None:
        a.out.write_text(text + "\n")
    if a.markdown is not None:
        a.markdown.write_text(markdown(rep))
    print(text)


if __name__ == "__main__":
    main()
