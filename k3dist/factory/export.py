"""A trained mini-K3 written in Moonshot's source format (``k3dist.factory.moonshot``):
the inverse of mlx-lm's ``sanitize``, BF16 except K3's F32 set, experts as MXFP4
``weight_packed``/``weight_scale``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from k3dist.factory import corpus, moonshot, synth
from k3dist.factory.minimodel import reset_caches
from k3dist.format import layout, mxfp4
from k3dist.format.sfile import f32_to_bf16_bits

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

# ----------------------------------------------------------------------------- export


MAX_EXPORT_BYTES = 30 * 1024 * 1024  # a shipped mini fits in the repository
F32_SOURCE = "F32"


def _mlx_name(source_name: str) -> str:
    """The MLX parameter a source tensor is (part of); experts excluded."""
    n = source_name.replace(".block_sparse_moe.", ".mlp.")
    n = n.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")
    for x in "qkv":
        n = n.replace(f".self_attn.{x}_proj.", ".self_attn.qkv_proj.")
        n = n.replace(f".self_attn.{x}_conv1d.weight", ".self_attn.qkv_conv.conv.weight")
    return n


def round_to_source(model: nn.Module, config: dict) -> None:
    """Round every parameter K3 stores as BF16 to bfloat16 (kept float32), so the
    in-memory model equals what ``export_source`` writes and ``load_model`` reads."""
    f32 = {_mlx_name(s.name) for s in layout.source_specs(config) if s.dtype == F32_SOURCE}
    flat = tree_flatten(model.parameters())
    new = [
        (k, v.astype(mx.bfloat16).astype(mx.float32))
        for k, v in flat
        if k not in f32 and mx.issubdtype(v.dtype, mx.floating)
    ]
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())
    reset_caches(model)


class _Exporter:
    def __init__(self, model: nn.Module, config: dict):
        self.p = dict(tree_flatten(model.parameters()))
        self.tc = layout.text_config(config)
        self._experts: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def _expert(self, layer: int, expert: int, w: str, kind: str) -> np.ndarray:
        base = (
            f"language_model.model.layers.{layer}.mlp.switch_mlp."
            + {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}[w]
        )
        if base not in self._experts:
            weight = self.p[base + ".weight"]
            if base + ".scales" in self.p:
                packed, scales = mxfp4.from_mlx(weight, self.p[base + ".scales"])
                self._experts[base] = (np.array(packed), np.array(scales))
            else:  # not frozen yet: encode now (same encoder as the freeze)
                self._experts[base] = mxfp4.encode(np.array(weight))
        packed, scales = self._experts[base]
        return (packed if kind == "weight_packed" else scales)[expert]

    def array(self, spec: layout.TensorSpec) -> np.ndarray:
        key = layout.parse_expert_key(spec.name)
        if key is not None:
            return self._expert(*key)
        name = spec.name
        src = _mlx_name(name)
        if ".self_attn.kv_b_proj." in name:
            a = name.replace("kv_b_proj.weight", "")
            wk = self.p[a + "embed_q.weight"].swapaxes(-1, -2)  # [heads, nope, kv_lora]
            wv = self.p[a + "unembed_out.weight"]  # [heads, v, kv_lora]
            v = mx.concatenate([wk, wv], axis=1)
            return np.array(v.reshape(-1, v.shape[-1]))
        v = self.p[src]
        for i, x in enumerate("qkv"):
            if f".self_attn.{x}_proj." in name:
                P = v.shape[0] // 3
                v = v[i * P : (i + 1) * P]
            elif f".self_attn.{x}_conv1d." in name:
                P = v.shape[0] // 3
                v = v[i * P : (i + 1) * P].moveaxis(1, 2)  # [P, ks, 1] -> [P, 1, ks]
        v = np.array(v.astype(mx.float32))
        if name.endswith("A_log"):
            v = np.concatenate([v, np.zeros(spec.shape[0] - v.shape[0], np.float32)])
        return v


def export_source(
    model: nn.Module,
    config: dict,
    out_dir: str | Path,
    tokenizer_dir: str | Path = corpus.TOKENIZER_DIR,
    seed: int = 0,
    provenance: dict | None = None,
    max_bytes: int | None = MAX_EXPORT_BYTES,
) -> Path:
    """Write the model as a Moonshot-format source checkpoint (``synth``'s layout): one
    shard per layer, experts MXFP4 per expert, BF16/F32 as K3, vision tower random
    (deterministic per seed; K3's format has one, this model has no vision)."""
    out = Path(out_dir)
    specs = layout.source_specs(config)
    total = sum(s.nbytes for s in specs)
    if max_bytes is not None and total > max_bytes:
        raise ValueError(
            f"this config exports {total:,} bytes, over the {max_bytes:,} "
            "budget; choose a smaller size (fewer experts or dimensions)"
        )
    tc = layout.text_config(config)
    ex = _Exporter(model, config)

    def data(s: layout.TensorSpec) -> bytes:
        if s.family == "vision":
            return synth.tensor_bytes(s, tc, seed)
        a = ex.array(s)
        if tuple(a.shape) != s.shape:
            raise ValueError(f"{s.name}: model gives {a.shape}, K3's layout wants {s.shape}")
        if s.dtype == "BF16":
            return f32_to_bf16_bits(a).tobytes()
        if s.dtype == "F32":
            return np.ascontiguousarray(a, np.float32).tobytes()
        return np.ascontiguousarray(a, np.uint8).tobytes()

    moonshot.write_source(out, config, data)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copyfile(Path(tokenizer_dir) / name, out / name)
    if provenance is not None:
        (out / "training.json").write_text(json.dumps(provenance, indent=2) + "\n")
    return out
