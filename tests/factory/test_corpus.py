"""The committed mini-K3 corpus and tokenizer: splits disjoint by document (and by group),
deterministic, reproducible from this interpreter's sources; the tokenizer round-trips
held-out text through both the tiktoken and the Hugging Face paths."""

from __future__ import annotations

import hashlib
import json
import random
import sys

from k3dist.factory import corpus
from k3dist.format import tokens as tk

import pytest
from fast_tokenizer import build_fast_tokenizer


@pytest.fixture(scope="module")
def docs() -> list[corpus.Document]:
    return corpus.load()


@pytest.fixture(scope="module")
def enc():
    return tk.load_encoding(corpus.TOKENIZER_DIR)


def test_splits_disjoint_by_document_and_group(docs):
    ids = [d.id for d in docs]
    assert len(ids) == len(set(ids))
    split_of_group: dict[str, set[str]] = {}
    for d in docs:
        split_of_group.setdefault(d.group, set()).add(d.split)
    assert all(len(s) == 1 for s in split_of_group.values()), "a group spans splits"
    by_split = {s: {d.id for d in corpus.load_split(s)} for s in corpus.SPLITS}
    assert sum(len(v) for v in by_split.values()) == len(docs)
    for a in corpus.SPLITS:
        for b in corpus.SPLITS:
            if a < b:
                assert not by_split[a] & by_split[b]
    # Both domains in every split, held-out large enough to measure per domain.
    st = corpus.stats(docs)
    for s in corpus.SPLITS:
        for dom in corpus.DOMAINS:
            assert st[s][dom]["docs"] >= 5, (s, dom, st[s][dom])
    for dom in corpus.DOMAINS:
        total = sum(st[s][dom]["bytes"] for s in corpus.SPLITS)
        assert 0.06 < st["eval"][dom]["bytes"] / total < 0.2


def test_manifest_matches_committed_corpus(docs):
    manifest = json.loads((corpus.CORPUS_DIR / corpus.MANIFEST_FILE).read_text())
    assert hashlib.sha256(corpus._jsonl(docs)).hexdigest() == manifest["sha256_jsonl"]
    st = corpus.stats(docs)
    for s in corpus.SPLITS:
        for dom in corpus.DOMAINS:
            for k in ("docs", "bytes"):
                assert manifest["stats"][s][dom][k] == st[s][dom][k]
    assert (corpus.CORPUS_DIR / corpus.CORPUS_FILE).stat().st_size < 4 * 2**20


def _built_here() -> bool:
    manifest = json.loads((corpus.CORPUS_DIR / corpus.MANIFEST_FILE).read_text())
    return manifest["source"].startswith(f"CPython {sys.version.split()[0]} ")


@pytest.mark.skipif(not _built_here(), reason="corpus was built by another CPython version")
def test_rebuild_from_interpreter_sources_is_identical(docs):
    rebuilt = corpus.build()
    assert corpus._jsonl(rebuilt) == corpus._jsonl(docs)


def test_split_assignment_ignores_input_order():
    raw = [
        dict(
            id=f"code:{i}",
            group=f"g{i // 2}",
            domain=("code", "prose")[i % 2],
            source=str(i),
            text="x" * (100 + i),
        )
        for i in range(200)
    ]
    a = {d.id: d.split for d in corpus.assign_splits(raw)}
    shuffled = raw[:]
    random.Random(1).shuffle(shuffled)
    assert {d.id: d.split for d in corpus.assign_splits(shuffled)} == a
    assert set(a.values()) == set(corpus.SPLITS)


def test_bad_names_and_heldout_tokenizer_text_refused(docs):
    with pytest.raises(ValueError, match="split must be one of"):
        corpus.load_split("test")
    with pytest.raises(ValueError, match="domain must be one of"):
        corpus.load_split("train", "chinese")
    with pytest.raises(ValueError, match="train split only"):
        corpus.training_text([d for d in docs if d.split == "eval"][:1])


def test_committed_tokenizer_is_k3_layout_and_roundtrips_heldout(enc):
    assert enc.n_vocab == corpus.BASE_VOCAB + tk.NUM_CONTROL_TOKENS
    config = json.loads((corpus.TOKENIZER_DIR / "tokenizer_config.json").read_text())
    assert config["added_tokens_decoder"][str(corpus.BASE_VOCAB)]["content"] == tk.BOS
    for d in corpus.load_split("eval"):
        ids = enc.encode_ordinary(d.text)
        assert max(ids) < corpus.BASE_VOCAB
        assert enc.decode(ids) == d.text, d.id


def test_fast_tokenizer_matches_tiktoken_on_heldout(enc, tmp_path):
    fast = build_fast_tokenizer(corpus.TOKENIZER_DIR)
    for d in corpus.load_split("eval")[:6]:
        text = d.text[:4000]
        assert fast.encode(text, add_special_tokens=False) == enc.encode_ordinary(text)
        assert fast.decode(enc.encode_ordinary(text)) == text


def test_train_tokenizer_on_train_split_deterministic_and_roundtrips(tmp_path):
    train = corpus.load_split("train")[:12]
    for out in (tmp_path / "a", tmp_path / "b"):
        assert corpus.train_tokenizer(train, out, vocab_size=600) == 600 + 256
    assert (tmp_path / "a" / "tiktoken.model").read_bytes() == (
        tmp_path / "b" / "tiktoken.model"
    ).read_bytes()
    small = tk.load_encoding(tmp_path / "a")
    for d in corpus.load_split("eval")[:8]:
        assert small.decode(small.encode_ordinary(d.text)) == d.text


def test_committed_tokenizer_is_what_train_tokenizer_makes(tmp_path):
    """~6 s: the full BPE on the train split reproduces data/tokenizer byte for byte."""
    corpus.train_tokenizer(corpus.load_split("train"), tmp_path)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (corpus.TOKENIZER_DIR / name).read_bytes()
