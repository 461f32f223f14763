"""K3's tiktoken files as a transformers fast tokenizer (tests compare it with tiktoken)."""

from __future__ import annotations

from pathlib import Path

from k3dist.format.tokens import CHAT_TEMPLATE, hf_tokenizer_config, tokenizer_backend


def build_fast_tokenizer(model_dir: Path):
    """K3's tiktoken files as a ``transformers.PreTrainedTokenizerFast`` with the chat template.

    Encodes like ``load_encoding(model_dir).encode(text, allowed_special="all")`` (control
    names in text become their tokens); decodes exactly, control tokens included.
    """
    from transformers import PreTrainedTokenizerFast

    model_dir = Path(model_dir)
    config = hf_tokenizer_config(model_dir)
    entries = list(config.pop("added_tokens_decoder").values())
    config.pop("tokenizer_class")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_backend(model_dir, entries),
        chat_template=CHAT_TEMPLATE,
        **config,
    )
