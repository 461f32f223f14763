"""mini-K3 checkpoints in Moonshot's own source format, at small dimensions.

The config is the real ``config.json`` (shipped in ``k3dist/data``) with sizes
overridden, so the key set is K3's; the tensors are the ones ``k3dist.format.layout``
derives from it, one shard per decoder layer like the real checkpoint, experts as
compressed-tensors MXFP4 bytes, ``A_log`` zero-padded to ``head_dim``. Weights are
random but deterministic per (seed, tensor name), so the order of writing does not
matter and every tool sees the same bytes.

    python -m k3dist.factory.synth --out mini-src --preset mini
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

from k3dist.factory import bpe, moonshot
from k3dist.format import layout
from k3dist.format import tokens as tokenizer
from k3dist.format.folder import REAL_K3_CONFIG
from k3dist.format.sfile import f32_to_bf16_bits

import numpy as np

# E2M1 codes drawn uniformly have this RMS; scales put experts at ~1/sqrt(fan_in).
_E2M1_RMS = math.sqrt((0 + 0.25 + 1 + 2.25 + 4 + 9 + 16 + 36) / 8)


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_layers: int
    attn_res_block_size: int
    kda_heads: int
    kda_head_dim: int
    mla_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    latent_size: int
    base_vocab: int
    vision_hidden: int = 32
    vision_layers: int = 2
    # Set: the real config's counts are kept (layers, pattern, experts, top-k, vocabulary,
    # vision blocks) and only the widths above apply; base_vocab is then the real one.
    real_counts: bool = False


PRESETS = {
    # Tests: seconds to write, convert and run; 16 experts split 2 or 4 ways.
    "mini": Preset(
        hidden_size=64,
        num_layers=6,
        attn_res_block_size=2,
        kda_heads=4,
        kda_head_dim=16,
        mla_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        intermediate_size=128,
        num_experts=16,
        experts_per_token=4,
        moe_intermediate_size=32,
        latent_size=32,
        base_vocab=512,
    ),
    # Benchmarks: routed experts are ~85% of ~450 MB, as they dominate the real model.
    "bench": Preset(
        hidden_size=1024,
        num_layers=8,
        attn_res_block_size=4,
        kda_heads=8,
        kda_head_dim=128,
        mla_heads=8,
        q_lora_rank=256,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        intermediate_size=2048,
        num_experts=128,
        experts_per_token=8,
        moe_intermediate_size=512,
        latent_size=512,
        base_vocab=512,
    ),
    # The rehearsal (issue 26): every count of the real K3 (93 layers, 896 experts top-16,
    # 2 shared, 163,840-entry vocabulary, 27 vision blocks; the index is the real one key
    # for key and shard for shard), widths shrunk; expert widths multiples of 64 so the
    # 2-bit g64 lo bank of the real plan exists. ~1.0 GB on disk.
    "k3counts": Preset(
        hidden_size=128,
        num_layers=93,
        attn_res_block_size=12,
        kda_heads=4,
        kda_head_dim=32,
        mla_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        intermediate_size=256,
        num_experts=896,
        experts_per_token=16,
        moe_intermediate_size=64,
        latent_size=64,
        base_vocab=163584,
        vision_layers=27,
        real_counts=True,
    ),
    # Training (k3dist.factory.train.SIZES): K3's ratios, scaled: latent = hidden/2,
    # shared experts 2 x moe_intermediate, MLA with q-LoRA and kv-LoRA, AttnRes blocks of
    # 2-3 layers. Parameter counts: k3dist.factory.train.describe(config).
    # 12.4M (4.1M active): 6 layers (MLA at 4 and 6), hidden 192, 64 experts top-4.
    "s": Preset(
        hidden_size=192,
        num_layers=6,
        attn_res_block_size=2,
        kda_heads=2,
        kda_head_dim=64,
        mla_heads=3,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        intermediate_size=512,
        num_experts=64,
        experts_per_token=4,
        moe_intermediate_size=96,
        latent_size=96,
        base_vocab=4096,
    ),
    # 31.9M (8.3M active): the note (9 layers, hidden 256, 64 experts top-4;
    # MLA at 4, 8, 9).
    # KDA 2 heads x 64: the CPU training path loops over time steps on a
    # [batch, heads, 64, 64] state, so heads cost linearly (4 heads: ~2.3x slower KDA).
    "m": Preset(
        hidden_size=256,
        num_layers=9,
        attn_res_block_size=3,
        kda_heads=2,
        kda_head_dim=64,
        mla_heads=4,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        intermediate_size=768,
        num_experts=64,
        experts_per_token=4,
        moe_intermediate_size=128,
        latent_size=128,
        base_vocab=4096,
    ),
    # Tests: well under a second a step, still every K3 feature (MLA at 4, 5; 64 experts).
    "tiny": Preset(
        hidden_size=64,
        num_layers=5,
        attn_res_block_size=2,
        kda_heads=2,
        kda_head_dim=32,
        mla_heads=2,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        intermediate_size=128,
        num_experts=64,
        experts_per_token=2,
        moe_intermediate_size=32,
        latent_size=32,
        base_vocab=4096,
    ),
}
# Tests of g64 / g128 lo banks: "mini" with routed experts and latent 128 wide.
PRESETS["mini128"] = replace(PRESETS["mini"], moe_intermediate_size=128, latent_size=128)
# Issue 27's second mini ("sparse"): expert and latent widths 128, so 2-bit g64/g128
# and 3-bit g64 exist; 128 experts top-8 (6.25% active) and 2 shared experts; otherwise
# `s` (6 layers, MLA at 4 and 6, hidden 192, KDA 2 x 64).
PRESETS["sparse"] = replace(
    PRESETS["s"], num_experts=128, experts_per_token=8, moe_intermediate_size=128, latent_size=128
)
# The same with 256 experts top-8 (3.1% active, nearer K3's 1.8%).
PRESETS["sparse256"] = replace(PRESETS["sparse"], num_experts=256)


def real_config() -> dict:
    """Moonshot's config.json for Kimi K3, unmodified."""
    return json.loads(REAL_K3_CONFIG.read_text())


def k3_layer_pattern(num_layers: int) -> tuple[list[int], list[int]]:
    """K3's 1-based layer lists: MLA at every 4th layer and the last, KDA elsewhere."""
    full = [i for i in range(1, num_layers + 1) if i % 4 == 0 or i == num_layers]
    kda = [i for i in range(1, num_layers + 1) if i not in full]
    return kda, full


def make_config(p: Preset, vocab_size: int) -> dict:
    """The real config with the preset's sizes; special-token ids keep their offsets."""
    cfg = copy.deepcopy(real_config())
    real_base = 163584  # real base vocab: ids past it are the 256 control tokens

    def remap(token_id: int) -> int:
        return token_id - real_base + (vocab_size - tokenizer.NUM_CONTROL_TOKENS)

    for d in (cfg, cfg["text_config"]):
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            d[k] = remap(d[k])
    cfg["media_placeholder_token_id"] = remap(cfg["media_placeholder_token_id"])

    kda, full = k3_layer_pattern(p.num_layers)
    tc = cfg["text_config"]
    if p.real_counts:
        real_tc = real_config()["text_config"]
        counts = {
            "num_hidden_layers": p.num_layers,
            "attn_res_block_size": p.attn_res_block_size,
            "num_experts": p.num_experts,
            "num_experts_per_token": p.experts_per_token,
            "vocab_size": vocab_size,
        }
        wrong = {k: (v, real_tc[k]) for k, v in counts.items() if real_tc[k] != v}
        if wrong or (kda, full) != (
            real_tc["linear_attn_config"]["kda_layers"],
            real_tc["linear_attn_config"]["full_attn_layers"],
        ):
            raise ValueError(
                f"a real-counts preset differs from the real config (key: (preset, real)): {wrong}"
            )
    tc.update(
        hidden_size=p.hidden_size,
        num_hidden_layers=p.num_layers,
        attn_res_block_size=p.attn_res_block_size,
        num_attention_heads=p.mla_heads,
        num_key_value_heads=p.mla_heads,
        q_lora_rank=p.q_lora_rank,
        kv_lora_rank=p.kv_lora_rank,
        qk_nope_head_dim=p.qk_nope_head_dim,
        qk_rope_head_dim=p.qk_rope_head_dim,
        v_head_dim=p.v_head_dim,
        intermediate_size=p.intermediate_size,
        num_experts=p.num_experts,
        num_experts_per_token=p.experts_per_token,
        moe_intermediate_size=p.moe_intermediate_size,
        routed_expert_hidden_size=p.latent_size,
        vocab_size=vocab_size,
        max_position_embeddings=4096,
    )
    tc["linear_attn_config"].update(
        kda_layers=kda, full_attn_layers=full, num_heads=p.kda_heads, head_dim=p.kda_head_dim
    )
    vc = cfg["vision_config"]
    vc.update(
        vt_hidden_size=p.vision_hidden,
        mm_hidden_size=p.vision_hidden,
        qkv_hidden_size=p.vision_hidden,
        vt_intermediate_size=2 * p.vision_hidden,
        vt_num_attention_heads=2,
        vt_num_hidden_layers=p.vision_layers,
        init_pos_emb_height=4,
        init_pos_emb_width=4,
        text_hidden_size=p.hidden_size,
    )
    return cfg


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def tensor_bytes(spec: layout.TensorSpec, tc: dict, seed: int) -> bytes:
    """Deterministic contents of one source tensor."""
    rng = _rng(seed, spec.name)
    shape = spec.shape
    leaf = spec.name.rsplit(".", 2)
    if spec.dtype == "U8":
        if spec.name.endswith("weight_packed"):
            return rng.integers(0, 256, size=shape, dtype=np.uint8).tobytes()
        fan_in = shape[1] * 32
        e = round(math.log2(1.0 / math.sqrt(fan_in) / _E2M1_RMS))
        return (127 + e + rng.integers(-1, 2, size=shape)).astype(np.uint8).tobytes()
    if spec.name.endswith("A_log"):
        heads = tc["linear_attn_config"]["num_heads"]
        x = np.zeros(shape, np.float32)
        x[:heads] = np.log(rng.uniform(1.0, 16.0, size=heads))
    elif spec.name.endswith("dt_bias"):
        x = rng.normal(0.0, 0.5, size=shape)
    elif spec.name.endswith("e_score_correction_bias"):
        x = rng.normal(0.0, 0.05, size=shape)
    elif "conv1d" in spec.name:
        x = rng.normal(0.0, 0.4, size=shape)
    elif len(shape) == 1:  # norm weights: near 1, not exactly, so a swap shows
        x = 1.0 + rng.normal(0.0, 0.1, size=shape)
    elif leaf[-2].endswith("res_proj"):
        x = rng.normal(0.0, 0.5, size=shape) / math.sqrt(shape[-1])
    elif "embed_tokens" in spec.name:
        x = rng.normal(0.0, 1.0, size=shape)
    else:
        fan_in = int(np.prod(shape[1:]))
        x = rng.normal(0.0, 1.0 / math.sqrt(fan_in), size=shape)
    x = np.asarray(x, np.float32)
    if spec.dtype == "F32":
        return x.tobytes()
    return f32_to_bf16_bits(x).tobytes()


def synthesize(out: str | Path, preset: str = "mini", seed: int = 0, progress: bool = True) -> Path:
    """Write a mini-K3 source checkpoint; returns its folder."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    if p.real_counts:
        ranks = bpe.padded_ranks(bpe.mini_tokenizer(512), p.base_vocab)
    else:
        ranks = bpe.mini_tokenizer(p.base_vocab)
    vocab_size = tokenizer.write_tokenizer_files(out, ranks)
    cfg = make_config(p, vocab_size)
    tc = cfg["text_config"]
    return moonshot.write_source(
        out, cfg, lambda s: tensor_bytes(s, tc, seed), desc=f"synth {preset}" if progress else None
    )


def main() -> None:
    ap = argparse.ArgumentParser(description="Write a mini-K3 checkpoint in Moonshot's format.")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--preset", default="mini", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = synthesize(args.out, args.preset, args.seed)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
