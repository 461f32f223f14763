"""Mini tokenizers in Kimi K3's exact on-disk layout.

K3 ships ``tiktoken.model`` (one ``base64(token_bytes) rank`` line per BPE token, ranks
0..base-1) plus ``tokenizer_config.json``. Ids ``base .. base+255`` are 256 control tokens:
16 are named in ``added_tokens_decoder``; every other slot is implicitly
``<|reserved_token_<id>|>`` (absolute id), filled in positionally by the loaders. We write
small vocabularies in that layout so the real loading code runs on them unchanged.

Provenance of the control-token table (real model: base 163,584, vocab 163,840):

* Confirmed by the real ``config.json`` (shipped as k3dist/data/kimi-k3-config.json):
  bos 163584 = base+0, eos 163586 = base+2, pad 163839 = base+255, media placeholder
  163605 = base+21; ``image_placeholder`` is the *text* "<|kimi_image_placeholder|>".
* Confirmed by mlx-vlm 0.7.10 ``models/kimi_k3``: the XTML names ``<|open|>``, ``<|sep|>``,
  ``<|close|>``, ``<|end_of_msg|>`` (encoding_k3.py); ``<|media_begin|>``,
  ``<|media_content|>``, ``<|media_end|>``, ``<|media_pad|>`` and that the placeholder text
  is expanded into those (processing_kimi_k3.py); 256 control slots with the
  ``<|reserved_token_{absolute id}|>`` fallback for ids the config does not name.
* The full 16-name id table below is identical across several independent public K3 ports
  found via code search (a Rust tiktoken port's ``kimi_k3()``, a splintr-style
  ``kimi_k3_special_tokens()``, a C GGUF loader, a JAX vocab module, and a design note
  listing ``added_tokens_decoder``). It agrees with every id the config pins.
* ``special: false`` for ``<|open|>``/``<|sep|>``/``<|close|>`` (true for the other 13)
  comes from one source only (the C loader's "special:true subset"); it matches K2, where
  structural tool-call markers are also ``special: false`` so they survive decoding.
* Top-level config keys mirror Kimi K2's tokenizer_config.json (assumption for K3).
  ``eos_token`` is "[EOS]", not ``<|end_of_msg|>``: two public PRs (ai-dynamo/dynamo#12395,
  smg-project/smg#2571) report that the tokenizer EOS differs from the generation stop id.
  K3 ships no ``chat_template`` (rendering is Python code), so none is written.

Serving files (``write_hf_tokenizer``, written into every build by ``k3dist.pipeline.convert``): a
``tokenizer.json`` converted with transformers' ``TikTokenConverter`` (K3's pattern, byte-level
BPE, the 256 control tokens as added tokens at their ids), a ``tokenizer_config.json`` that
plain ``AutoTokenizer.from_pretrained`` loads without remote code, and ``chat_template.jinja``
(the file beside this module). ``tiktoken.model`` stays, so ``load_encoding`` still reads
the folder.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

from k3dist.format.folder import CONFIG_NAME, load_config

import regex
import tiktoken

NUM_CONTROL_TOKENS = 256

BOS = "[BOS]"
EOS = "[EOS]"
END_OF_MSG = "<|end_of_msg|>"
OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
MEDIA_BEGIN = "<|media_begin|>"
MEDIA_CONTENT = "<|media_content|>"
MEDIA_END = "<|media_end|>"
MEDIA_PAD = "<|media_pad|>"
UNK = "[UNK]"
PAD = "[PAD]"
# Plain text in rendered prompts, expanded by the processor into media tokens; not a token.
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
XTML_TOKENS = (OPEN, CLOSE, SEP, END_OF_MSG)

# Offset from the base vocab size -> name, for the 16 slots K3 names.
NAMED_CONTROL_TOKENS: dict[int, str] = {
    0: BOS,
    1: EOS,
    2: END_OF_MSG,
    3: OPEN,
    4: CLOSE,
    5: SEP,
    6: "[start_header_id]",
    7: "[end_header_id]",
    9: "[EOT]",
    18: MEDIA_BEGIN,
    19: MEDIA_CONTENT,
    20: MEDIA_END,
    21: MEDIA_PAD,
    65: "<osagent_mode>",
    254: UNK,
    255: PAD,
}
# Structural markers must survive skip_special_tokens decoding for the XTML parsers.
_NON_SPECIAL = frozenset({OPEN, CLOSE, SEP})

# Same as K2 (transformers' VERY_LARGE_INTEGER); K3's value is not known to us.
_MODEL_MAX_LENGTH = int(1e30)

# K3's pre-tokenizer regex, as in K3's tokenization_kimi.py / mlx-vlm. tiktoken (Rust
# fancy-regex over the regex crate) accepts the ``&&`` class intersection as is, so no
# rewrite is needed; Python's ``regex`` needs the V1 flag for it (see _SPLIT_RE).
_NOT_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NOT_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
K3_PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}*{_NOT_HAN_LOWER}+{_CONTRACTION}",
        rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}+{_NOT_HAN_LOWER}*{_CONTRACTION}",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
# Python-side splitter for training; tests check it splits exactly like tiktoken.
_SPLIT_RE = regex.compile(K3_PAT_STR, flags=regex.V1)


def control_tokens(base_vocab_size: int) -> list[str]:
    """The 256 control-token names for ids base_vocab_size .. base_vocab_size+255."""
    return [
        NAMED_CONTROL_TOKENS.get(i, f"<|reserved_token_{base_vocab_size + i}|>")
        for i in range(NUM_CONTROL_TOKENS)
    ]


def special_tokens(base_vocab_size: int) -> dict[str, int]:
    """{name: id} for all 256 control tokens."""
    return {name: base_vocab_size + i for i, name in enumerate(control_tokens(base_vocab_size))}


def split_text(text: str) -> list[str]:
    """Pre-tokenize with K3_PAT_STR (the pieces BPE merges never cross)."""
    return _SPLIT_RE.findall(text)


def _tokenizer_config(base_vocab_size: int) -> dict:
    added = {}
    for offset, name in sorted(NAMED_CONTROL_TOKENS.items()):
        added[str(base_vocab_size + offset)] = {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": name not in _NON_SPECIAL,
        }
    return {
        "added_tokens_decoder": added,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": BOS,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "extra_special_tokens": {},
        "model_max_length": _MODEL_MAX_LENGTH,
        "pad_token": PAD,
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": UNK,
    }


def write_tokenizer_files(out_dir: Path, ranks: dict[bytes, int]) -> int:
    """Write tiktoken.model + tokenizer_config.json in K3's layout; return the full vocab size."""
    base = len(ranks)
    if sorted(ranks.values()) != list(range(base)):
        raise ValueError("ranks must be exactly 0..len(ranks)-1")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = (
        f"{base64.b64encode(tok).decode('ascii')} {rank}\n"
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    )
    (out_dir / "tiktoken.model").write_text("".join(lines), encoding="ascii")
    config = json.dumps(_tokenizer_config(base), indent=2, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
    return base + NUM_CONTROL_TOKENS


def read_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken.model file.

    Not tiktoken.load.load_tiktoken_bpe: that caches even local files by path hash in
    $TMPDIR/data-gym-cache, so a rewritten file at the same path would load stale ranks.
    """
    ranks: dict[bytes, int] = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def _read_config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "tokenizer_config.json").read_text(encoding="utf-8"))


def _control_entries(config: dict, base_vocab_size: int) -> list[dict]:
    """The 256 control tokens as ``added_tokens_decoder`` entries, in id order.

    Positional like K3's loader: a slot the config does not name is
    ``<|reserved_token_<id>|>``, special. Named slots keep the config's flags.
    """
    named = config.get("added_tokens_decoder", {})
    entries = []
    for i in range(base_vocab_size, base_vocab_size + NUM_CONTROL_TOKENS):
        given = named.get(str(i), {})
        entries.append(
            {
                "content": given.get("content", f"<|reserved_token_{i}|>"),
                "lstrip": given.get("lstrip", False),
                "normalized": given.get("normalized", False),
                "rstrip": given.get("rstrip", False),
                "single_word": given.get("single_word", False),
                "special": given.get("special", True),
            }
        )
    return entries


def load_encoding(model_dir: Path) -> tiktoken.Encoding:
    """tiktoken Encoding for a K3-layout tokenizer directory (base vocab + 256 controls)."""
    model_dir = Path(model_dir)
    ranks = read_ranks(model_dir / "tiktoken.model")
    base = len(ranks)
    entries = _control_entries(_read_config(model_dir), base)
    return tiktoken.Encoding(
        name=model_dir.name or "k3",
        pat_str=K3_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={e["content"]: base + i for i, e in enumerate(entries)},
    )


# ----------------------------------------------------------------------------- Hugging Face files

# What K3's own loader (and mlx-vlm's conversion of it) does before the regex: cut text into
# 400,000-character pieces, then after every run of 25,000 whitespace or non-whitespace
# characters, so the regex engine never sees a pathological run. Text without such runs
# encodes exactly as ``load_encoding`` does.
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000
HF_TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # in transformers 5: TokenizersBackend, local
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# K3's XTML chat format as a Jinja template (a data file beside this module)
CHAT_TEMPLATE = (Path(__file__).with_name(CHAT_TEMPLATE_FILE)).read_text(encoding="utf-8")


def tokenizer_backend(model_dir: Path, entries: list[dict]):
    """A ``tokenizers.Tokenizer`` equal to ``load_encoding(model_dir)``."""
    from tokenizers import AddedToken, Regex, pre_tokenizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class Converter(TikTokenConverter):
        # tiktoken's loader caches local files by path; a rewritten file would load stale.
        @staticmethod
        def load_tiktoken_bpe(path: str) -> dict[bytes, int]:
            return read_ranks(Path(path))

    backend = Converter(
        vocab_file=str(model_dir / "tiktoken.model"), pattern=K3_PAT_STR, extra_special_tokens=None
    ).converted()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.FixedLength(_MAX_ENCODE_CHARS),
            pre_tokenizers.Split(
                Regex(rf"\s{{{_MAX_RUN_CHARS}}}|\S{{{_MAX_RUN_CHARS}}}"),
                behavior="merged_with_previous",
            ),
            pre_tokenizers.Split(Regex(K3_PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    base = backend.get_vocab_size()
    backend.add_tokens(
        [
            AddedToken(
                e["content"],
                single_word=e["single_word"],
                lstrip=e["lstrip"],
                rstrip=e["rstrip"],
                normalized=e["normalized"],
                special=e["special"],
            )
            for e in entries
        ]
    )
    wrong = [
        (e["content"], base + i, backend.token_to_id(e["content"]))
        for i, e in enumerate(entries)
        if backend.token_to_id(e["content"]) != base + i
    ]
    if wrong or backend.get_vocab_size() != base + NUM_CONTROL_TOKENS:
        raise ValueError(
            f"{model_dir}: control tokens did not land on ids {base}.."
            f"{base + NUM_CONTROL_TOKENS - 1} (name, wanted, got): {wrong[:5]}; "
            "is a control name also a BPE token, or named twice?"
        )
    return backend


def _eos_token(model_dir: Path, config: dict, entries: list[dict], base: int) -> str:
    """The model's stop token: config.json's ``eos_token_id`` if given, else the tokenizer's.

    K3's tokenizer_config says "[EOS]" but its config.json says ``<|end_of_msg|>`` (163586),
    which ends every chat message; mlx-lm stops at the tokenizer's eos, so use the latter.
    """
    path = model_dir / CONFIG_NAME
    eos = load_config(model_dir).get("eos_token_id") if path.exists() else None
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None:
        return config.get("eos_token", EOS)
    if not base <= eos < base + NUM_CONTROL_TOKENS:
        raise ValueError(
            f"{path}: eos_token_id {eos} is not a control token "
            f"({base}..{base + NUM_CONTROL_TOKENS - 1})"
        )
    return entries[eos - base]["content"]


def hf_tokenizer_config(model_dir: Path) -> dict:
    """tokenizer_config.json for the fast tokenizer: K3's keys, no remote code, all 256
    control tokens listed, eos = the model's stop token (see ``_eos_token``)."""
    model_dir = Path(model_dir)
    config = _read_config(model_dir)
    base = len(read_ranks(model_dir / "tiktoken.model"))
    entries = _control_entries(config, base)
    out = {
        k: v
        for k, v in config.items()
        if k not in ("auto_map", "tokenizer_class", "chat_template", "added_tokens_decoder")
    }
    out["added_tokens_decoder"] = {str(base + i): e for i, e in enumerate(entries)}
    out["eos_token"] = _eos_token(model_dir, config, entries, base)
    out["clean_up_tokenization_spaces"] = False  # decode must return the bytes as they are
    out["tokenizer_class"] = HF_TOKENIZER_CLASS
    return out


def write_hf_tokenizer(src_dir: Path, out_dir: Path) -> list[str]:
    """Write tokenizer.json, tokenizer_config.json (replacing K3's remote-code one) and
    chat_template.jinja into out_dir, keeping tiktoken.model; returns the names written.

    ``src_dir`` holds K3's tiktoken.model + tokenizer_config.json (+ config.json for the stop
    token); it may be out_dir itself. Afterwards ``AutoTokenizer.from_pretrained(out_dir)``
    works without trust_remote_code, and ``load_encoding(out_dir)`` is unchanged.
    """
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    config = hf_tokenizer_config(src_dir)
    backend = tokenizer_backend(src_dir, list(config["added_tokens_decoder"].values()))
    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / "tiktoken.model").resolve() != (src_dir / "tiktoken.model").resolve():
        shutil.copyfile(src_dir / "tiktoken.model", out_dir / "tiktoken.model")
    (out_dir / "tokenizer.json").write_text(backend.to_str(pretty=True) + "\n", encoding="utf-8")
    text = json.dumps(config, indent=2, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(text + "\n", encoding="utf-8")
    (out_dir / CHAT_TEMPLATE_FILE).write_text(CHAT_TEMPLATE, encoding="utf-8")
    return ["tiktoken.model", "tokenizer.json", "tokenizer_config.json", CHAT_TEMPLATE_FILE]
