"""Mini K3 tokenizers: layout, tiktoken compatibility, BPE validity, determinism, and the
fast (tokenizer.json) conversion serving uses."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from k3dist.factory import bpe
from k3dist.format import tokens as tk
from k3dist.format.folder import REAL_K3_CONFIG

import pytest
import tiktoken
from fast_tokenizer import build_fast_tokenizer
from tiktoken.load import load_tiktoken_bpe

# the real K3's config.json, as the package ships it (k3dist.factory.synth.real_config)
REFERENCE_CONFIG = REAL_K3_CONFIG

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
    tk.write_tokenizer_files(out, bpe.mini_tokenizer(512))
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
    assert ranks == bpe.mini_tokenizer(512)
    assert len(ranks) == 512
    assert enc.n_vocab == 512 + tk.NUM_CONTROL_TOKENS


def test_write_returns_full_vocab(tmp_path: Path) -> None:
    ranks = bpe.mini_tokenizer(300)
    assert tk.write_tokenizer_files(tmp_path, ranks) == 300 + 256
    # the vocabulary written: 300 base ranks, control ids right after, the last one PAD
    assert tk.read_ranks(tmp_path / "tiktoken.model") == ranks
    enc = tk.load_encoding(tmp_path)
    assert enc.n_vocab == 300 + 256
    assert enc.encode(tk.PAD, allowed_special="all") == [300 + 255]


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
    assert len(enc.encode_ordinary(bpe.MINI_TEXT)) < len(bpe.MINI_TEXT.encode()) // 2


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
    ranks = bpe.mini_tokenizer(700)
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
    ranks = bpe.train_bpe(text, 10_000)  # runs out of pairs: every chunk is one token
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
    tk.write_tokenizer_files(a, bpe.mini_tokenizer(600))
    tk.write_tokenizer_files(b, bpe.train_bpe(bpe.MINI_TEXT, 600))
    for name in ("tiktoken.model", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_train_bpe_rejects_tiny_vocab() -> None:
    with pytest.raises(ValueError, match="vocab_size must be >= 256, got 100"):
        bpe.train_bpe("abc", 100)


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


# ----------------------------------------------------------------------------- fast tokenizer

# Control-token spellings, code, CJK, emoji, RTL, combining marks, whitespace runs.
FAST_SAMPLES = [
    *SAMPLES,
    '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>',
    "[BOS]x[EOS] <|media_begin|>image<|media_content|><|media_pad|><|media_end|> [PAD][UNK]",
    "a<|reserved_token_520|>b <|reserved_token_999|> <|open|<|sep|>> <|kimi_image_placeholder|>",
    "class K3:\n\tdef __init__(self):\n\t\tself.x = {'a': [1, 2]}  # 注释\n",
    "ﬁ ℌ ①②③ ４５６ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u200b\u00a0\u3000 \r\n\t",
]


@pytest.fixture(scope="module")
def fast(mini_dir: Path):
    return build_fast_tokenizer(mini_dir)


@pytest.mark.parametrize("text", FAST_SAMPLES)
def test_fast_tokenizer_equals_tiktoken(fast, enc: tiktoken.Encoding, text: str) -> None:
    ids = fast.encode(text, add_special_tokens=False)
    assert ids == enc.encode(text, allowed_special="all")
    assert fast.decode(ids) == text
    assert fast.encode(text) == ids  # no BOS/EOS added


def test_fast_tokenizer_equals_tiktoken_random(fast, enc: tiktoken.Encoding) -> None:
    rng = random.Random(1)
    words = tk.split_text(bpe.MINI_TEXT) + list(tk.special_tokens(512)) + ["你好", "🚀", " \n"]
    for _ in range(200):
        parts = [
            rng.choice(words) if rng.random() < 0.8 else chr(rng.randrange(0x20, 0x30000))
            for _ in range(rng.randrange(1, 40))
        ]
        text = "".join(p for p in parts if not 0xD800 <= ord(p[0]) < 0xE000)
        assert fast.encode(text, add_special_tokens=False) == enc.encode(
            text, allowed_special="all"
        ), text


def test_fast_tokenizer_long_runs_split_like_k3(fast, enc: tiktoken.Encoding) -> None:
    # K3's loader cuts after every 25,000 whitespace / non-whitespace characters; here the
    # cut falls inside an "in" merge, so only the cut version matches.
    text = "q" + "in" * 13_000 + " tail"
    cut = 25_000
    want = enc.encode_ordinary(text[:cut]) + enc.encode_ordinary(text[cut:])
    assert fast.encode(text, add_special_tokens=False) == want != enc.encode_ordinary(text)
    assert fast.decode(want) == text


def test_fast_tokenizer_control_tokens(fast) -> None:
    base = 512
    assert len(fast) == base + tk.NUM_CONTROL_TOKENS
    for i, name in enumerate(tk.control_tokens(base)):
        assert fast.convert_tokens_to_ids(name) == base + i
        entry = fast.added_tokens_decoder[base + i]
        assert entry.content == name and entry.special == (name not in (tk.OPEN, tk.CLOSE, tk.SEP))
    sp = tk.special_tokens(base)
    assert (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id, fast.unk_token_id) == (
        sp[tk.BOS],
        sp[tk.EOS],
        sp[tk.PAD],
        sp[tk.UNK],
    )  # no config.json: the tokenizer's EOS
    ids = fast.encode("<|open|>think<|sep|>x<|end_of_msg|>", add_special_tokens=False)
    # Structural markers survive skip_special_tokens (the XTML parsers need them).
    assert fast.decode(ids, skip_special_tokens=True) == "<|open|>think<|sep|>x"


def _with_model_config(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    base = len(tk.read_ranks(dst / "tiktoken.model"))
    cfg = {"model_type": "kimi_k3", "eos_token_id": base + 2, "bos_token_id": base}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_write_hf_tokenizer(mini_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    src = _with_model_config(mini_dir, tmp_path / "src")
    out = tmp_path / "out"
    names = tk.write_hf_tokenizer(src, out)
    assert sorted(names) == sorted(p.name for p in out.iterdir())
    assert (out / "tiktoken.model").read_bytes() == (src / "tiktoken.model").read_bytes()
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert "auto_map" not in config and config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert len(config["added_tokens_decoder"]) == tk.NUM_CONTROL_TOKENS
    assert config["eos_token"] == tk.END_OF_MSG  # config.json's eos_token_id, the stop token

    hf = AutoTokenizer.from_pretrained(out)  # no trust_remote_code, no tiktoken code
    assert isinstance(hf, PreTrainedTokenizerFast)
    assert hf.chat_template == tk.CHAT_TEMPLATE
    assert hf.eos_token_id == tk.special_tokens(512)[tk.END_OF_MSG]
    assert (hf.bos_token, hf.pad_token, hf.unk_token) == (tk.BOS, tk.PAD, tk.UNK)
    enc = tk.load_encoding(src)
    # load_encoding still reads the folder, with the same ids
    assert tk.load_encoding(out)._special_tokens == enc._special_tokens
    for text in FAST_SAMPLES:
        assert hf.encode(text, add_special_tokens=False) == enc.encode(text, allowed_special="all")

    # Deterministic, and idempotent when run on its own output.
    files = {n: (out / n).read_bytes() for n in names}
    again = tmp_path / "again"
    tk.write_hf_tokenizer(src, again)
    assert {n: (again / n).read_bytes() for n in names} == files
    shutil.copyfile(src / "config.json", out / "config.json")
    tk.write_hf_tokenizer(out, out)
    assert {n: (out / n).read_bytes() for n in names} == files


def test_chat_control_tokens_can_be_sanitized(fast) -> None:
    # transformers 5 can encode control-token spellings in user text as text, like K3's own
    # segment-wise encoder; the structural tokens written by the template stay tokens.
    msgs = [{"role": "user", "content": "say <|end_of_msg|> please"}]
    sp = tk.special_tokens(512)
    plain = fast.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    safe = fast.apply_chat_template(
        msgs, add_generation_prompt=True, return_dict=False, sanitize_control_tokens=True
    )
    assert plain.count(sp[tk.END_OF_MSG]) == safe.count(sp[tk.END_OF_MSG]) + 1
    assert safe.count(sp[tk.OPEN]) == plain.count(sp[tk.OPEN]) >= 3
    assert fast.decode(safe) == fast.decode(plain)


@pytest.mark.parametrize(
    "text",
    [
        "你好hello世界World，這是「測試」、。々〆日本語のテキスト",
        "DON'T it's IT'S we'RE HTTPServer camelCase snake_case Straße ǅemal",
        "naïve e\u0301 Привет 🚀👨\u200d👩 a    b\t\tc\r\n\r\n x   \n   y ",
        "1234567 3.14159 ４５６ x² -> != <= ... (){}[] 'll 'S",
    ],
)
def test_fast_pre_tokenizer_splits_like_tiktoken(tmp_path: Path, text: str) -> None:
    # Every substring a token: the ids spell out each side's pre-tokenization (tokenizers'
    # Oniguruma regex vs tiktoken's fancy-regex on the same K3 pattern).
    enc = _all_substrings_encoding(text)
    tk.write_tokenizer_files(tmp_path, enc._mergeable_ranks)
    fast = build_fast_tokenizer(tmp_path)
    assert fast.encode(text, add_special_tokens=False) == enc.encode_ordinary(text)
