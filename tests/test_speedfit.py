"""The calibrated speed model (k3dist.bench.speedfit): the fit recovers terms it is given,
every anchor says where it comes from, and the shipped result holds each published point
within the issue's 20 % with the figures docs/speed.md quotes."""

from __future__ import annotations

import json
from pathlib import Path

from k3dist.bench import speedfit as sf

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "benchmarks" / "results" / "2026-12-06" / "speed.json"


def _synthetic(th: dict) -> sf.Counts:
    """Decode points of one stack at growing context and batch, and prefill points at
    growing prompts, their tok/s made by ``th`` itself (no config: counts given)."""
    c = sf.Counts.__new__(sf.Counts)
    c.anchors, c.counts = [], []
    for ctx, b in ((512, 1), (65536, 1), (131072, 1), (512, 8), (512, 32)):
        counts = {
            "bytes": 30e9 + 2e9 * b,
            "flops_mm": 2e11 * b,
            "flops_attn": 2e6 * ctx * b,
            "comm_s": 5e-3,
        }
        c.anchors.append(
            sf.Anchor(
                f"d{ctx}-{b}", "decode", "ep4", "tp", "jaccl", "uvmax", 1.0, context=ctx, batch=b
            )
        )
        c.counts.append(counts)
    for p in (575, 8192, 65536):
        chunks = [
            {
                "bytes": 40e9,
                "flops_mm": 1e11 * n,
                "flops_attn": 1e6 * n * (i * 2048 + n),
                "comm_s": 0.05,
                "tokens": n,
            }
            for i, n in enumerate([2048] * (p // 2048) + ([p % 2048] if p % 2048 else []))
        ]
        c.anchors.append(
            sf.Anchor(f"p{p}", "prefill", "ep4", "tp", "jaccl", "uvmax", 1.0, context=p)
        )
        c.counts.append(chunks)
    c.anchors = [
        sf.Anchor(**{**a.__dict__, "value": c.predict(th, i)}) for i, a in enumerate(c.anchors)
    ]
    return c


def test_fit_recovers_the_terms_that_made_the_points():
    th = {"eta": 0.7, "phi_mm": 0.5, "phi_attn": 0.3, "phi_mla": 0.4, "O:ep4": 0.02, "Op:ep4": 0.8}
    got = sf.fit(_synthetic(th))
    for k, v in th.items():
        assert got[k] == pytest.approx(v, rel=0.02), k


def test_every_anchor_names_its_source():
    for a in sf.ANCHORS:
        assert a.source and ("github.com" in a.source), a.name
    assert {a.stack for a in sf.ANCHORS} == set(sf.STACKS)


def test_shipped_result_within_20_percent_and_docs_quote_it():
    rep = json.loads(RESULT.read_text())
    assert rep["command"].startswith("python benchmarks/speed/published_fit.py")
    for r in rep["fit"]["anchors"]:
        assert abs(r["residual"]) <= 0.20, r["anchor"]
    doc = (REPO / "docs" / "speed.md").read_text()
    g = rep["goals"]
    for key, fmt in (("decode_b1_tok_s", "{:.2f}"), ("prefill_8k_tok_s", "{:.1f}")):
        assert fmt.format(g[key]["best_projected"]) in doc, key
    for name, v in rep["fit"]["terms"].items():
        assert f"| {name} | {v:.4g} |" in doc, name
