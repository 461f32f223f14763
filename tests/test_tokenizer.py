"""Mini K3 tokenizers: layout, tiktoken compatibility, BPE validity, determinism."""

from __future__ import annotations

import json
import random
from pathlib import Path

from k3dist import tokenizer as tk

import pytest
import tiktoken
from tiktoken.load import load_tiktoken_bpe

REFERENCE_CONFIG = Path("/work/shared/reference/kimi-k3-config.json")

SAMPLES = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\tprint(f(3))\r\n",
    "你好，世界！這是「測試」、。日本語のテキスト",
    "emoji 🚀🔥 family 👨\u200d👩\u200d👧 flags 🇯🇵",
    "naïve café e\u0301 Привет мир مرحبا DON'T it's",
    "a    b\t\t\tc   \n   d\n\n\n",
    "",
]


@pytest.fixture(scope="module")
def mini_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mini_tok")
    tk.write_tokenizer_files(out, tk.mini_tokenizer(512))
    return out


@pytest.fixture(scope="module")
def enc(mini_dir: Path) -> tiktoken.Encoding:
    return tk.load_encoding(mini_dir)


def test_files_load_with_tiktoken(
    mini_dir: Path, monkeypatch: pytest.MonkeyPatch, enc: tiktoken.Encoding
) -> None:
    # The loader real K3 code uses; "" disables its path-keyed cache.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    ranks = load_tiktoken_bpe(str(mini_dir / "tiktoken.model"))
    assert ranks == tk.mini_tokenizer(512)
    assert len(ranks) == 512
    assert enc.n_vocab == 512 + tk.NUM_CONTROL_TOKENS


def test_write_returns_full_vocab(tmp_path: Path) -> None:
    assert tk.write_tokenizer_files(tmp_path, tk.mini_tokenizer(300)) == 300 + 256


@pytest.mark.parametrize("text", SAMPLES)
def test_roundtrip_text(enc: tiktoken.Encoding, text: str) -> None:
    ids = enc.encode_ordinary(text)
    assert all(0 <= i < 512 for i in ids)
    assert enc.decode(ids) == text


def test_roundtrip_arbitrary_bytes(enc: tiktoken.Encoding) -> None:
    rng = random.Random(0)
    data = bytes(range(256)) + bytes(rng.randrange(256) for _ in range(2000))  # not UTF-8
    # Every single byte is a token, so any byte string is representable.
    assert enc.decode_bytes(list(data)) == data
    assert enc.decode_bytes(enc._encode_bytes(data)) == data  # tiktoken's bytes entry point
    # Random code points from all planes (surrogates excluded) round-trip as text.
    chars = (rng.randrange(0x110000) for _ in range(3000))
    text = "".join(chr(c) for c in chars if not 0xD800 <= c < 0xE000)
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_merges_compress_training_text(enc: tiktoken.Encoding) -> None:
    assert len(enc.encode_ordinary(tk.MINI_TEXT)) < len(tk.MINI_TEXT.encode()) // 2


def test_control_token_layout(mini_dir: Path, enc: tiktoken.Encoding) -> None:
    base = 512
    names = tk.control_tokens(base)
    assert len(names) == len(set(names)) == 256
    assert names[0] == tk.BOS and names[2] == tk.END_OF_MSG
    assert names[21] == tk.MEDIA_PAD and names[255] == tk.PAD
    assert names[8] == f"<|reserved_token_{base + 8}|>"
    specials = tk.special_tokens(base)
    assert sorted(specials.values()) == list(range(base, base + 256))
    for name in tk.XTML_TOKENS:
        assert name in specials
        assert enc.encode(name, allowed_special="all") == [specials[name]]
        assert enc.decode([specials[name]]) == name
    # Control names are plain text unless special tokens are allowed.
    assert specials[tk.OPEN] not in enc.encode_ordinary(tk.OPEN)

    config = json.loads((mini_dir / "tokenizer_config.json").read_text())
    decoder = config["added_tokens_decoder"]
    assert {int(i): e["content"] for i, e in decoder.items()} == {
        base + off: name for off, name in tk.NAMED_CONTROL_TOKENS.items()
    }
    assert all(
        set(e) == {"content", "lstrip", "normalized", "rstrip", "single_word", "special"}
        for e in decoder.values()
    )
    assert config["tokenizer_class"] == "TikTokenTokenizer"
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (
        "[BOS]",
        "[EOS]",
        "[PAD]",
    )
    assert "chat_template" not in config


def test_xtml_turn_encodes(enc: tiktoken.Encoding) -> None:
    sp = tk.special_tokens(512)
    text = '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>'
    ids = enc.encode(text, allowed_special="all")
    assert ids[0] == sp[tk.OPEN] and ids[-1] == sp[tk.END_OF_MSG]
    assert enc.decode(ids) == text


def test_real_size_ids_match_reference_config() -> None:
    if not REFERENCE_CONFIG.exists():
        pytest.skip("reference config not available")
    cfg = json.loads(REFERENCE_CONFIG.read_text())
    base = 163_584
    assert cfg["text_config"]["vocab_size"] == base + tk.NUM_CONTROL_TOKENS
    sp = tk.special_tokens(base)
    assert sp[tk.BOS] == cfg["bos_token_id"]
    assert sp[tk.END_OF_MSG] == cfg["eos_token_id"]
    assert sp[tk.PAD] == cfg["pad_token_id"]
    assert sp[tk.MEDIA_PAD] == cfg["media_placeholder_token_id"]
    assert cfg["image_placeholder"] == tk.IMAGE_PLACEHOLDER
    # The placeholder is prompt text expanded by the processor, not a control token.
    assert tk.IMAGE_PLACEHOLDER not in sp
    assert tk.control_tokens(base)[-2] == tk.UNK
    assert "<|reserved_token_163592|>" in sp


def test_bpe_rank_validity() -> None:
    ranks = tk.mini_tokenizer(700)
    assert sorted(ranks.values()) == list(range(700))
    assert all(ranks[bytes([b])] == b for b in range(256))
    for tok, rank in ranks.items():
        if len(tok) > 1:  # some split into two strictly lower-ranked tokens
            assert any(
                ranks.get(tok[:i], rank) < rank and ranks.get(tok[i:], rank) < rank
                for i in range(1, len(tok))
            ), tok


def test_tiktoken_reproduces_training_segmentation() -> None:
    text = "the theme of these three thermal threads: the then-thin thesis"
    ranks = tk.train_bpe(text, 10_000)  # runs out of pairs: every chunk is one token
    assert len(ranks) < 10_000
    enc = tiktoken.Encoding("t", pat_str=tk.K3_PAT_STR, mergeable_ranks=ranks, special_tokens={})
    pieces = [enc.decode_single_token_bytes(i) for i in enc.encode_ordinary(text)]
    assert pieces == [p.encode() for p in tk.split_text(text)]


def _all_substrings_encoding(text: str) -> tiktoken.Encoding:
    # With every substring a token, tiktoken's BPE collapses each regex piece into one
    # token, so the token list *is* tiktoken's own pre-tokenization.
    data = text.encode()
    subs = {data[i:j] for i in range(len(data)) for j in range(i + 2, len(data) + 1)}
    ranks = {bytes([b]): b for b in range(256)}
    for s in sorted(subs, key=lambda s: (len(s), s)):
        ranks[s] = len(ranks)
    return tiktoken.Encoding("s", pat_str=tk.K3_PAT_STR, mergeable_ranks=ranks, special_tokens={})


@pytest.mark.parametrize(
    "text",
    [
        "你好hello世界World，這是「測試」、。々〆日本語のテキスト",
        "DON'T it's IT'S we'RE HTTPServer camelCase snake_case Straße",
        "naïve e\u0301 Привет 🚀👨\u200d👩 a    b\t\tc\r\n\r\n x   \n   y ",
        "1234567 3.14159 ４５６ x² -> != <= ... (){}[]",
    ],
)
def test_python_split_matches_tiktoken(text: str) -> None:
    enc = _all_substrings_encoding(text)
    pieces = [enc.decode_single_token_bytes(i) for i in enc.encode_ordinary(text)]
    assert pieces == [p.encode() for p in tk.split_text(text)]


def test_determinism(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    tk.write_tokenizer_files(a, tk.mini_tokenizer(600))
    tk.write_tokenizer_files(b, tk.train_bpe(tk.MINI_TEXT, 600))
    for name in ("tiktoken.model", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_train_bpe_rejects_tiny_vocab() -> None:
    with pytest.raises(ValueError):
        tk.train_bpe("abc", 100)


def test_mlx_lm_recognizes_xtml_vocab(mini_dir: Path) -> None:
    # The conversion mlx-vlm applies to K3's tiktoken files (no tokenizer.json shipped).
    from mlx_lm.tokenizer_utils import _infer_thinking, _infer_tool_parser, _is_xtml_vocab
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    config = json.loads((mini_dir / "tokenizer_config.json").read_text())
    backend = TikTokenConverter(
        vocab_file=str(mini_dir / "tiktoken.model"),
        pattern=tk.K3_PAT_STR,
        extra_special_tokens=tk.control_tokens(512),
    ).converted()
    skip = {"added_tokens_decoder", "auto_map", "tokenizer_class"}
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend, **{k: v for k, v in config.items() if k not in skip}
    )
    vocab = hf.get_vocab()
    assert len(vocab) == 768
    assert _is_xtml_vocab(vocab)
    assert _infer_tool_parser(hf) == "kimi_k3"
    sp = tk.special_tokens(512)
    think_ids = _infer_thinking(hf)[2]
    assert think_ids[0] == sp[tk.OPEN] and think_ids[-1] == sp[tk.SEP]
    assert (hf.eos_token_id, hf.pad_token_id) == (sp[tk.EOS], sp[tk.PAD])
    enc = tk.load_encoding(mini_dir)
    for text in SAMPLES[:5]:
        assert hf.encode(text, add_special_tokens=False) == enc.encode_ordinary(text)
