"""The converter: parity with mlx-lm's own loader, bit-exact experts, mlx-lm's
quantization reproduced, resume, and bad input refused before anything is written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from k3dist.bench.greedy import greedy
from k3dist.format import layout, mxfp4
from k3dist.format.layout import EXPERT_PROJ
from k3dist.format.manifest import JOURNAL
from k3dist.format.sfile import CheckpointError, read_bytes, read_header, read_numpy
from k3dist.format.source import Source
from k3dist.pipeline import convert as convert_mod

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import kimi_k3
from mlx_lm.utils import load_model, quantize_model
from util import load_f32, prompt_ids

STEPS = 32


def dequantized_reference(src: Path):
    """A float kimi_k3 whose experts are our numpy decoding of the source bytes:
    independent of MLX's mxfp4 kernels and of the converter."""
    s = Source(src)
    cfg = json.loads(json.dumps(s.config))
    cfg.pop("quantization_config", None)
    cfg["text_config"].pop("quantization_config", None)
    weights = {}
    for name in s.weight_map:
        if name.startswith(("vision_tower.", "mm_projector.")):
            continue
        key = layout.parse_expert_key(name)
        if key is None:
            weights[name] = mx.load(str(s.info(name).path))[name]
        elif key[3] == "weight_packed":
            scale = name.replace("weight_packed", "weight_scale")
            w = mxfp4.decode(read_numpy(s.info(name)), read_numpy(s.info(scale)))
            weights[name.replace("weight_packed", "weight")] = mx.array(w)
    model = kimi_k3.Model(kimi_k3.ModelArgs.from_dict(cfg))
    model.load_weights(list(model.sanitize(weights).items()))
    model.eval()
    model.set_dtype(mx.float32)
    return model


def test_build_matches_mlx_lm_oracle_and_dequantized_reference(mini_src, mini_build):
    oracle, _ = load_f32(mini_src)  # mlx-lm reading Moonshot's format directly
    build, _ = load_f32(mini_build)
    ref = dequantized_reference(mini_src)
    vocab = Source(mini_src).text_config["vocab_size"]
    prompt = prompt_ids(vocab, 16)

    t_oracle, l_oracle = greedy(oracle, prompt, STEPS)
    t_build, l_build = greedy(build, prompt, STEPS)
    t_ref, l_ref = greedy(ref, prompt, STEPS)

    d_oracle = float(np.abs(l_oracle - l_build).max())
    d_ref = float(np.abs(l_ref - l_build).max())
    scale = float(np.abs(l_build).max())
    print(
        f"\nmax |logit| {scale:.3f}; build vs mlx-lm on source: {d_oracle:.3g}; "
        f"build vs numpy-dequantized float model: {d_ref:.3g}"
    )
    # Same bytes, same kernels: identical. The float reference differs only by
    # summation order (quantized vs dense matmul) in float32.
    assert d_oracle == 0.0
    assert d_ref < 1e-3 * max(scale, 1.0)
    assert t_build == t_oracle == t_ref
    assert len(set(t_build)) > 1  # a constant sequence would prove little


def test_every_expert_byte_identical_to_source(mini_src, mini_build):
    src = Source(mini_src)
    tc = src.text_config
    bh = {}
    for f in json.loads((mini_build / "model.safetensors.index.json").read_text())[
        "weight_map"
    ].values():
        bh.setdefault(f, read_header(mini_build / f))
    tensors = {n: t for h in bh.values() for n, t in h.tensors.items()}
    checked = 0
    for layer in range(tc["num_hidden_layers"]):
        if not layout.is_moe_layer(tc, layer):
            continue
        for w, dst in EXPERT_PROJ.items():
            for kind, suffix in (("weight_packed", "weight"), ("weight_scale", "scales")):
                t = tensors[f"language_model.model.layers.{layer}.mlp.switch_mlp.{dst}.{suffix}"]
                stacked = read_bytes(t)
                per = len(stacked) // tc["num_experts"]
                for e in range(tc["num_experts"]):
                    name = f"{layout.LAYER_PREFIX}{layer}.block_sparse_moe.experts.{e}.{w}.{kind}"
                    assert stacked[e * per : (e + 1) * per] == read_bytes(src.info(name)), name
                    checked += 1
    assert checked == sum(1 for n in src.weight_map if layout.parse_expert_key(n))


def test_manifest_hashes_and_identity(mini_build):
    m = json.loads((mini_build / "k3dist.json").read_text())
    assert m["identity"]["nonexpert_bits"] == 16
    from k3dist.format.sfile import sha256_file

    for name, meta in m["files"].items():
        assert sha256_file(mini_build / name) == meta["sha256"], name
    assert not (mini_build / JOURNAL).exists()
    assert (mini_build / "tiktoken.model").exists()
    assert (mini_build / "tokenizer_config.json").exists()


def test_nonexpert_8bit_equals_mlx_lm_quantization(mini_src, tmp_path):
    """Streaming per layer gives exactly what mlx-lm's quantize_model gives on the
    whole model (experts stay mxfp4: quantize_model skips quantized modules)."""
    out = convert_mod.convert(mini_src, tmp_path / "b8", nonexpert_bits=8, progress=False)
    ours, cfg = load_f32(out)
    theirs, _ = load_model(mini_src)  # source dtypes, as the converter reads them
    theirs, _ = quantize_model(theirs, {}, 64, 8)
    theirs.set_dtype(mx.float32)
    a, b = dict(tree_flatten(ours.parameters())), dict(tree_flatten(theirs.parameters()))
    assert set(a) == set(b)
    diff = [k for k in a if not mx.array_equal(a[k], b[k]).item()]
    assert diff == []
    gate = cfg["quantization"]["language_model.model.layers.1.mlp.gate"]
    assert gate == {"group_size": 64, "bits": 8, "mode": "affine"}
    sw = cfg["quantization"]["language_model.model.layers.1.mlp.switch_mlp.gate_proj"]
    assert sw == {"group_size": 32, "bits": 4, "mode": "mxfp4"}


def test_resume_after_interruption(mini_src, mini_build, tmp_path, monkeypatch):
    out = tmp_path / "resumed"
    calls = {"n": 0}
    real_chunks = convert_mod.iter_chunks

    def failing_chunks(info, *a, **k):
        calls["n"] += 1
        if calls["n"] == 40:  # mid-way through layer 1's expert stream
            raise KeyboardInterrupt("simulated crash")
        yield from real_chunks(info, *a, **k)

    monkeypatch.setattr(convert_mod, "iter_chunks", failing_chunks)
    with pytest.raises(KeyboardInterrupt):
        convert_mod.convert(mini_src, out, progress=False)
    journal = json.loads((out / JOURNAL).read_text())
    assert list(journal["done"]) == ["layer.0"]
    assert not (out / "model-layer-001.safetensors").exists()  # no complete-looking file
    assert not (out / "k3dist.json").exists()

    monkeypatch.setattr(convert_mod, "iter_chunks", real_chunks)
    convert_mod.convert(mini_src, out, progress=False)
    a = json.loads((out / "k3dist.json").read_text())["files"]
    b = json.loads((mini_build / "k3dist.json").read_text())["files"]
    assert a == b  # same bytes as an uninterrupted run
    assert not list(out.glob("*.partial"))


def _corrupt_copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "bad-src"
    shutil.copytree(src, dst)
    return dst


def _rewrite_header(path: Path, name: str, **changes) -> None:
    """Change one tensor's header entry in place (the data stays where it was)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header[name].update(changes)
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n, "test helper: header grew"
    path.write_bytes(raw[:8] + new + b" " * (n - len(new)) + raw[8 + n :])


def _shard(src: Path, name: str) -> Path:
    return src / Source(src).weight_map[name]


L1 = "language_model.model.layers.1."
BAD_INPUTS = {
    "truncated shard": lambda s: _shard(s, L1 + "input_layernorm.weight").write_bytes(
        _shard(s, L1 + "input_layernorm.weight").read_bytes()[:-100]
    ),
    "missing shard": lambda s: _shard(s, L1 + "input_layernorm.weight").unlink(),
    "index names an absent tensor": lambda s: _index_add(
        s, L1 + "self_attn.q_proj.weight", "model-00005-of-000009.safetensors"
    ),
    "wrong dtype": lambda s: _rewrite_header(
        _shard(s, L1 + "self_attn.dt_bias"), L1 + "self_attn.dt_bias", dtype="I32"
    ),
    "wrong shape": lambda s: _rewrite_header(
        _shard(s, L1 + "block_sparse_moe.experts.3.w2.weight_scale"),
        L1 + "block_sparse_moe.experts.3.w2.weight_scale",
        shape=[16, 2],
    ),
    "non-zero A_log tail": lambda s: _poke_a_log(s),
    "unknown quantization format": lambda s: _set_quant_format(s, "nvfp4-pack-quantized"),
}
EXPECT = {
    "truncated shard": ("model-00002-of-000009.safetensors", "truncated"),
    "missing shard": ("model-00002-of-000009.safetensors", "missing"),
    "index names an absent tensor": ("self_attn.q_proj.weight", "does not hold it"),
    "wrong dtype": ("self_attn.dt_bias", "I32[64]"),
    "wrong shape": ("experts.3.w2.weight_scale", "[16, 2]"),
    "non-zero A_log tail": ("layer 1", "A_log"),
    "unknown quantization format": ("nvfp4-pack-quantized", "config.json"),
}


def _index_add(src: Path, name: str, fname: str) -> None:
    p = src / "model.safetensors.index.json"
    idx = json.loads(p.read_text())
    idx["weight_map"][name] = fname  # moved to a shard that does not hold it
    p.write_text(json.dumps(idx))


def _poke_a_log(src: Path) -> None:
    name = L1 + "self_attn.A_log"
    t = read_header(_shard(src, name)).tensors[name]
    with open(t.path, "r+b") as f:
        f.seek(t.end - 4)
        f.write(np.float32(0.5).tobytes())


def _set_quant_format(src: Path, fmt: str) -> None:
    p = src / "config.json"
    cfg = json.loads(p.read_text())
    cfg["text_config"]["quantization_config"]["format"] = fmt
    p.write_text(json.dumps(cfg))


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_specific_error_and_nothing_written(mini_src, tmp_path, case):
    src = _corrupt_copy(mini_src, tmp_path)
    BAD_INPUTS[case](src)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as e:
        convert_mod.convert(src, out, progress=False)
    msg = str(e.value)
    print(f"\n{case}: {msg}")
    for part in EXPECT[case]:
        assert part in msg
    assert not out.exists() or not any(out.iterdir())


def test_refuses_out_folder_with_different_build(mini_src, mini_build, tmp_path):
    out = tmp_path / "b"
    shutil.copytree(mini_build, out)
    with pytest.raises(CheckpointError, match="different build.*nonexpert_bits"):
        convert_mod.convert(mini_src, out, nonexpert_bits=8, progress=False)
    # the same build again is a no-op, not an error
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    convert_mod.convert(mini_src, out, progress=False)
    assert before == {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not a k3dist build"):
        convert_mod.convert(mini_src, foreign, progress=False)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_cli(mini_src, tmp_path):
    out = tmp_path / "cli"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "k3dist.pipeline.convert",
            "--src",
            str(mini_src),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert (out / "k3dist.json").exists()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "k3dist.pipeline.convert",
            "--src",
            str(out / "nope"),
            "--out",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0 and "error:" in r.stderr and "nope" in r.stderr


# every class a different format, so a module filed under the wrong class shows
PER_CLASS = {
    "attention": "6bit-g64",
    "shared": "5bit-g64",
    "latent": "8bit-g64",
    "router": "4bit-g64",
    "dense_mlp": "3bit-g64",
    "embed": "4bit-g32",
    "lm_head": "8bit-g128",
}


def _oracle_predicate(path: str, module) -> dict | bool:
    """Written from the mlx-lm module names, independently of plan.module_class."""
    if not hasattr(module, "to_quantized") or "switch_mlp" in path or path.endswith("res_proj"):
        return False
    if path.startswith(("vision_tower", "mm_projector")):
        return False
    if ".self_attn." in path:
        c = "attention"
    elif ".shared_experts." in path:
        c = "shared"
    elif "routed_expert_" in path:
        c = "latent"
    elif path.endswith("mlp.gate"):
        c = "router"
    elif path.endswith(("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")):
        c = "dense_mlp"
    else:
        c = {"language_model.model.embed_tokens": "embed", "language_model.lm_head": "lm_head"}[
            path
        ]
    bits, group = (int(x) for x in PER_CLASS[c].split("bit-g"))
    cols = module.weight.shape[-1]
    while cols % group:
        group //= 2
    return {"group_size": group, "bits": bits, "mode": "affine"}


def test_per_class_nonexpert_equals_mlx_lm_quantization(mini_src, tmp_path):
    """``--nonexpert CLASS=FORMAT,...``: mlx-lm's loader reads the per-path formats,
    and the weights and logits are exactly mlx-lm's quantize_model of the source with
    the same per-class formats (g32 where the columns are not a multiple of 64)."""
    spec = ",".join(f"{c}={f}" for c, f in PER_CLASS.items())
    out = convert_mod.convert(mini_src, tmp_path / "pc", progress=False, nonexpert=spec)
    ours, cfg = load_f32(out)
    theirs, _ = load_model(mini_src)
    # group 32 as the default: quantize_model skips columns it does not divide
    theirs, qcfg = quantize_model(theirs, {}, 32, 8, quant_predicate=_oracle_predicate)
    theirs.set_dtype(mx.float32)
    a, b = dict(tree_flatten(ours.parameters())), dict(tree_flatten(theirs.parameters()))
    assert set(a) == set(b)
    assert [k for k in a if not mx.array_equal(a[k], b[k]).item()] == []
    q = {
        k: v
        for k, v in cfg["quantization"].items()
        if isinstance(v, dict) and "switch_mlp" not in k
    }
    assert q == {k: v for k, v in qcfg["quantization"].items() if isinstance(v, dict)}
    assert q["language_model.model.layers.3.self_attn.q_b_proj"]["group_size"] == 32  # 96 cols
    # 192 columns: g128 drops to g64
    assert q["language_model.lm_head"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    prompt = mx.array([prompt_ids(cfg["text_config"]["vocab_size"], 24)])
    assert mx.array_equal(ours(prompt), theirs(prompt)).item()
    m = json.loads((out / "k3dist.json").read_text())
    assert m["identity"]["nonexpert"] == PER_CLASS
    att = [f"{v['bits']}bit-g{v['group_size']}" for k, v in q.items() if ".self_attn." in k]
    assert m["profile"]["nonexpert_modules"]["attention"] == {
        f: att.count(f) for f in ("6bit-g64", "6bit-g32")
    }
    # a uniform build of the same source is another build
    with pytest.raises(CheckpointError, match="different build"):
        convert_mod.convert(mini_src, out, nonexpert_bits=8, progress=False)


def test_per_class_nonexpert_refuses_nonsense(mini_src, tmp_path):
    for spec, why in (
        ("attn=6bit-g64", "unknown class 'attn'"),
        ("attention=mxfp4", "affine formats"),
        ("attention=7bit-g64", "write <bits>bit-g<group>"),
    ):
        with pytest.raises(ValueError, match=why):
            convert_mod.convert(mini_src, tmp_path / "x", progress=False, nonexpert=spec)
    assert not (tmp_path / "x").exists()
