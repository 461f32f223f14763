"""The shipped defaults are the calibrated speed table's choices (issue 40): each default
equals what benchmarks/speed/published_fit.py's table chooses by its stated rule,
re-applied here to the table's rows, so a re-fit that changes the best row fails until
the default follows."""

from __future__ import annotations

import json
from pathlib import Path

from k3dist.model import forms

import yaml

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "benchmarks" / "results" / "2026-12-06" / "speed.json"


def _defaults() -> dict:
    rep = json.loads(RESULT.read_text())
    assert rep["command"].startswith("python benchmarks/speed/published_fit.py")
    return rep["defaults"]


def _best(d: dict, key, among=lambda r: True) -> dict:
    """The rule re-applied to the rows; it must be the row the table cites."""
    got = max((r for r in d["rows"] if among(r)), key=key)
    assert got == d["chosen"], (got, d["chosen"])
    return got


def test_backend_is_the_tables_and_the_guide_recommends_it():
    d = _defaults()["backend"]
    best = _best(d, lambda r: r["decode_b1_2k_tok_s"])
    hostfile = json.loads((REPO / best["hostfile"]).read_text())
    assert hostfile["backend"] == best["backend"]
    # docs/speed.md states the choice with its row
    doc = (REPO / "docs" / "speed.md").read_text()
    assert f"`{best['hostfile']}`" in doc and f"{best['decode_b1_2k_tok_s']:.2f}" in doc
    # hostfiles/README.md names it the choice, with the two rows' figures
    guide = (REPO / "hostfiles" / "README.md").read_text()
    name = Path(best["hostfile"]).name
    assert f"`{name}` is the calibrated speed table's choice" in " ".join(guide.split())
    for r in d["rows"]:
        assert f"{r['decode_b1_2k_tok_s']:.2f}" in guide, r["backend"]


def test_moe_form_on_metal_is_the_tables():
    defaults = _defaults()
    d = defaults["moe_form_metal"]
    best = _best(d, lambda r: (r["decode_b1_2k_tok_s"], r["prefill_8k_tok_s"]))
    dep = yaml.safe_load((REPO / "deploy" / "tb5.yaml").read_text())
    assert dep["moe_form"] == "auto" and forms.METAL_FORM == best["form"]
    rows = defaults["local_from_tokens"]["rows"]
    faster = [r["local_s"] < r["placeholder_s"] for r in rows]
    first = next(i for i in range(len(rows)) if all(faster[i:]))
    assert rows[first] == defaults["local_from_tokens"]["chosen"]
    assert forms.LOCAL_FROM_TOKENS == rows[first]["tokens"]
    n = forms.LOCAL_FROM_TOKENS
    assert forms.form_for("phased", n) == "local" and forms.form_for("phased", n - 1) == (
        "placeholder"
    )
    assert forms.form_for("placeholder", 4096) == "placeholder"


def test_max_batch_and_prefill_chunk_are_the_tables():
    defaults = _defaults()
    dep = yaml.safe_load((REPO / "deploy" / "tb5.yaml").read_text())
    b = _best(defaults["max_batch"], lambda r: r["decode_2k_tok_s"], lambda r: r["fits"])
    assert dep["max_batch"] == b["max_batch"]
    c = _best(defaults["prefill_chunk"], lambda r: r["prefill_8k_tok_s"], lambda r: r["free"])
    assert dep["prefill_chunk"] == c["prefill_chunk"]
    for r in defaults["prefill_chunk"]["rows"]:
        assert r["free"] == (r["activations_gb"] <= r["join_copy_gb"])
