"""Memory preflight: the real folder against this machine, pretend numbers for Metal."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import k3dist
from k3dist.config.deployment import Deployment, load_deployment
from k3dist.factory.synth import real_config
from k3dist.format import kvmemory, layout
from k3dist.serve import preflight
from k3dist.serve.preflight import GiB, MiB, PreflightError

import mlx.core as mx
import pytest
from util import REPO


def test_preflight_fits_and_reports(mini_build):
    dep = Deployment(
        memory_headroom_gib=64 * MiB / GiB, max_batch=8, max_context=4096, prefill_chunk=32
    )
    report = preflight.preflight(mini_build, dep)  # float32: the default
    files = sorted(Path(mini_build).glob("*.safetensors"))
    data = 0
    for f in files:  # data = file minus the 8-byte length and the JSON header
        n = int.from_bytes(f.read_bytes()[:8], "little")
        data += f.stat().st_size - 8 - n
    assert report["weights_bytes"] == data > 0
    assert report["footprint_bytes"] == data + 64 * MiB
    kv = preflight.kv_need(mini_build, max_batch=8, max_context=4096, dtype="float32")
    assert report["kv_need_bytes"] == kv["total"] > 0 and report["kv"]["batch"] == 8
    act = preflight.activation_need(mini_build, max_context=4096, prefill_chunk=32, dtype="float32")
    assert report["activations_bytes"] == act["total"] > 0
    # the mini's 8-request batch-join copy outgrows a 32-token chunk's activations
    assert kv["requests"] > act["total"]
    assert report["need_bytes"] == kv["total"] + kv["requests"] <= 64 * MiB
    assert report["free_bytes"] > report["footprint_bytes"]
    assert report["free_source"].startswith(
        "/proc/meminfo" if sys.platform == "linux" else "vm_stat"
    )
    if not mx.metal.is_available():
        assert report["metal"] is None and report["wired_limit_set_bytes"] is None
    else:
        assert report["wired_limit_set_bytes"] == report["footprint_bytes"]
    json.dumps(report)  # serve prints it as evidence


def test_preflight_refuses_with_numbers_and_fix(mini_build):
    footprint = preflight.folder_weight_bytes(mini_build) + GiB
    one = Deployment(
        memory_headroom_gib=1, max_batch=1, max_context=256, prefill_chunk=32, dtype="bfloat16"
    )
    with pytest.raises(PreflightError) as e:
        preflight.preflight(
            mini_build,
            one,
            free_bytes=footprint - 4096,
        )
    msg = str(e.value)
    assert f"{footprint:,} bytes" in msg and f"{footprint - 4096:,} bytes" in msg
    assert "fix:" in msg and "--size" in msg and str(mini_build) in msg


def test_preflight_refuses_a_folder_without_weights(tmp_path):
    with pytest.raises(PreflightError, match="no \\*.safetensors"):
        preflight.preflight(
            tmp_path,
            Deployment(memory_headroom_gib=1, max_batch=1, max_context=256, prefill_chunk=32),
        )


def test_metal_wired_limit_fix_names_the_sysctl():
    metal = {
        "max_recommended_working_set_bytes": 96 * GiB,
        "memory_bytes": 128 * GiB,
        "iogpu_wired_limit_mb": 0,
    }
    weights, head = 100 * GiB, 8 * GiB
    with pytest.raises(PreflightError) as e:
        preflight.check_memory("rank0", weights, head, 120 * GiB, "given", metal)
    assert f"sudo sysctl iogpu.wired_limit_mb={(weights + head) // MiB}" in str(e.value)
    # Beyond what the machine can wire at all: no sysctl can help, say so.
    with pytest.raises(PreflightError, match="more than this machine can wire") as e:
        preflight.check_memory("rank0", 126 * GiB, head, 200 * GiB, "given", metal)
    assert "sysctl" not in str(e.value)
    assert preflight.check_memory("rank0", 80 * GiB, head, 120 * GiB, "given", metal) == 88 * GiB


def test_free_memory_parsers():
    vm_stat = (
        "Mach Virtual Memory Statistics: (page size of 16384 bytes)\n"
        "Pages free:                               10000.\n"
        "Pages active:                            500000.\n"
        "Pages inactive:                           20000.\n"
        "Pages speculative:                         3000.\n"
    )
    assert preflight.parse_vm_stat(vm_stat) == 30000 * 16384
    assert preflight.parse_meminfo("MemTotal: 100 kB\nMemAvailable:   2048 kB\n") == 2048 * 1024
    with pytest.raises(ValueError, match="MemAvailable"):
        preflight.parse_meminfo("MemTotal: 100 kB\n")


# ----------------------------------------------------------------- KV cache and state

# The real K3 (k3dist/data/kimi-k3-config.json, ../shared/reference's) by hand: 93 layers,
# MLA at 4, 8, ..., 92 and 93 (24 layers) keep kv_lora_rank 512 + qk_rope_head_dim 64 = 576
# values a token; the 69 KDA layers keep 96 heads x 128^2 F32 (6,291,456 B) + a conv state
# of (4 - 1) x 3 x 96 x 128 values (221,184 B in bf16): 6,512,640 B a layer.
K3_LATENT_PER_TOKEN = 24 * 576 * 2  # 27,648 B, bf16
K3_KDA = 69 * (96 * 128 * 128 * 4 + 3 * 3 * 96 * 128 * 2)  # 449,372,160 B


def _rank_folder(tmp_path, config: dict, size: int = 2, split: bool = True) -> Path:
    """A folder with the config and the attention part of a rank manifest (kv_need reads
    no more)."""
    tc = layout.text_config(config)
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    layers = list(range(tc["num_hidden_layers"])) if split else []
    (tmp_path / "k3dist.json").write_text(
        json.dumps(
            {
                "kind": "rank",
                "rank": 0,
                "size": size,
                "attention": {"mode": "split" if split else "replicated", "split_layers": layers},
            }
        )
    )
    return tmp_path


def test_k3_kv_numbers_equal_the_hand_calculation(tmp_path):
    tc = layout.text_config(real_config())
    assert K3_LATENT_PER_TOKEN == 27_648 and K3_KDA == 449_372_160
    one = kvmemory.request_bytes(tc, 131072, 2)
    assert one["mla_latent_cache"] == 131072 * K3_LATENT_PER_TOKEN == 3_623_878_656
    assert one["kda_state"] == K3_KDA
    assert one["per_request"] == 4_073_250_816  # 4.07 GB a request at 128K, replicated
    # a rank holding half the heads (attention split) holds half the KDA state, all the latent
    split = kvmemory.request_bytes(tc, 131072, 2, size=2)
    assert split["kda_state"] == K3_KDA // 2 and split["per_request"] == 3_848_564_736
    # not a multiple of the 256-token cache step: rounded up
    assert kvmemory.request_bytes(tc, 1000, 2)["mla_latent_cache"] == 1024 * 27_648
    # float32 doubles the latent and the conv state, not the F32 recurrent state
    f32 = kvmemory.request_bytes(tc, 256, 4)
    assert f32["mla_latent_cache"] == 256 * 24 * 576 * 4
    assert f32["kda_state"] == 69 * (96 * 128 * 128 * 4 + 3 * 3 * 96 * 128 * 4)
    # deploy/tb5.yaml's load from a rank folder sliced with attention split over 2 ranks
    kv = preflight.kv_need(
        _rank_folder(tmp_path, real_config()),
        max_batch=4,
        max_context=131072,
        prompt_cache_tokens=131072,
        dtype="bfloat16",
    )
    assert kv["requests"] == 4 * 3_848_564_736
    pc = kv["prompt_cache"]  # 131072 held + one 131072-token entry being inserted, 9 entries
    assert pc["tokens_held_at_most"] == 262_144 and pc["entries_at_most"] == 9
    assert pc["total"] == (262_144 + 9 * 255) * 27_648 + 9 * K3_KDA // 2 == 9_333_384_192
    assert kv["total"] == 15_394_258_944 + 9_333_384_192 == 24_727_643_136  # 23.03 GiB
    # and a 512-token prefill chunk at 128K: 48 of the 96 MLA heads on this rank
    act = preflight.activation_need(
        _rank_folder(tmp_path, real_config()),
        max_context=131072,
        prefill_chunk=512,
        dtype="bfloat16",
    )
    assert act["attention_heads"] == 48
    assert act["mla_kv_decompressed"] == 48 * 131072 * (128 + 128) * 2 == 3_221_225_472
    assert act["attention_scores"] == 2 * 48 * 512 * 131072 * 2 == 12_884_901_888
    assert act["logits"] == 512 * 163_840 * 4  # F32
    assert act["hidden_and_attnres_stack"] == 512 * 7168 * 2 * (2 * 8 + 4)  # 8 AttnRes blocks
    assert act["moe"] == 512 * 16 * 3072 * 3 * 2
    assert act["total"] == 16_739_467_264
    assert kv["total"] + act["total"] == 41_467_110_400  # 38.62 GiB: tb5.yaml keeps 44


def test_a_batch_the_headroom_cannot_hold_is_refused_with_the_fix(tmp_path):
    folder = _rank_folder(tmp_path / "r0", real_config())
    # tb5.yaml before: max_batch 8 (the default) at 128K, the default 4 x 128K prompt
    # cache, 24 GiB of headroom: 8 x 3.85 GB of KV alone is more than 24 GiB
    kv = preflight.kv_need(folder, max_batch=8, max_context=131072, dtype="bfloat16")
    assert kv["requests"] == 8 * 3_848_564_736 > 24 * GiB
    with pytest.raises(PreflightError) as e:
        preflight.check_memory(folder, 400 * GiB, 24 * GiB, 500 * GiB, "given", None, kv)
    msg = str(e.value)
    assert str(folder) in msg and f"{kv['total']:,} bytes" in msg and f"{24 * GiB:,}" in msg
    assert "max_batch 8 requests" in msg and "max_context 131,072 tokens" in msg
    for fix in (
        "fix:",
        "lower max_batch, max_context or prompt_cache_tokens",
        # held + the batch-join copy of the 8 requests' caches
        f"raise memory_headroom_gib above {-(-(kv['total'] + kv['requests']) // GiB)}",
        "smaller build",
    ):
        assert fix in msg, fix
    # what fits: 4 requests and a 128K prompt cache under 40 GiB
    fits = preflight.kv_need(
        folder, max_batch=4, max_context=131072, prompt_cache_tokens=131072, dtype="bfloat16"
    )
    assert (
        preflight.check_memory(folder, 400 * GiB, 40 * GiB, 500 * GiB, "given", None, fits)
        == 440 * GiB
    )
    # replicated attention: the whole KDA state on every rank, more to hold
    whole = preflight.kv_need(
        _rank_folder(tmp_path / "r1", real_config(), split=False),
        max_batch=4,
        max_context=131072,
        prompt_cache_tokens=131072,
    )
    assert whole["total"] > fits["total"] and whole["attention_ranks"] == 1


def test_headroom_for_the_kv_but_not_the_prefill_is_refused(tmp_path):
    """tb5.yaml's limits with 40 GiB would hold the KV (24.73 GB) and a 512-token chunk's
    activations (16.74 GB), 41.47 GB; 2048-token chunks quadruple the attention scores:
    82.02 GB."""
    folder = _rank_folder(tmp_path, real_config())
    limits = {"max_batch": 4, "max_context": 131072, "prompt_cache_tokens": 131072}
    kv = preflight.kv_need(folder, **limits)
    act = {
        c: preflight.activation_need(folder, max_context=131072, prefill_chunk=c)
        for c in (512, 2048)
    }
    assert kv["total"] + act[512]["total"] <= 40 * GiB < kv["total"] + act[2048]["total"]
    assert (
        preflight.check_memory(folder, 400 * GiB, 40 * GiB, 500 * GiB, "given", None, kv, act[512])
        == 440 * GiB
    )
    with pytest.raises(PreflightError) as e:
        preflight.check_memory(folder, 400 * GiB, 40 * GiB, 500 * GiB, "given", None, kv, act[2048])
    msg, need = str(e.value), kv["total"] + act[2048]["total"]
    assert str(folder) in msg and f"{need:,} bytes" in msg and f"{40 * GiB:,}" in msg
    assert f"{act[2048]['total']:,} bytes" in msg and "prefill_chunk of 2,048 tokens" in msg
    for fix in (
        "fix:",
        "lower max_batch, max_context, prompt_cache_tokens or prefill_chunk",
        f"raise memory_headroom_gib above {-(-need // GiB)}",
    ):
        assert fix in msg, fix
    # through preflight() itself: one request (13.18 GB of KV with the prompt cache) and a
    # 512-token chunk (16.74 GB) are 27.87 GiB, more than 16 GiB
    (folder / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
    with pytest.raises(PreflightError, match="prefill_chunk of 512 tokens"):
        preflight.preflight(
            folder,
            Deployment(
                memory_headroom_gib=16,
                max_batch=1,
                max_context=131072,
                prompt_cache_tokens=1,
                prefill_chunk=512,
                dtype="bfloat16",
            ),
            free_bytes=1 << 50,
            set_wired=False,
        )


def test_a_prompt_joining_a_large_batch_counts_its_copy(tmp_path):
    """8 requests at 128K with 64-token prefill chunks: the batch-join copy of the
    caches (8 x 3.85 GB) outgrows a chunk's activations, and the need counts it."""
    folder = _rank_folder(tmp_path, real_config())
    kv = preflight.kv_need(folder, max_batch=8, max_context=131072, prompt_cache_tokens=1)
    act = preflight.activation_need(folder, max_context=131072, prefill_chunk=64)
    assert kv["requests"] == 8 * 3_848_564_736 > act["total"]
    need = kvmemory.need_bytes(kv, act)
    assert need["transient"] == kv["requests"]
    assert need["total"] == kv["total"] + kv["requests"]
    between = kv["total"] + act["total"] + GiB  # holds the prefill, not the join
    assert between < need["total"]
    with pytest.raises(PreflightError, match="joining the decode batch copies its caches"):
        preflight.check_memory(folder, 400 * GiB, between, 1 << 50, "given", None, kv, act)
    room = -(-need["total"] // GiB) * GiB
    assert (
        preflight.check_memory(folder, 400 * GiB, room, 1 << 50, "given", None, kv, act)
        == 400 * GiB + room
    )


def test_preflight_refuses_a_context_the_headroom_cannot_hold(mini_build):
    big = preflight.kv_need(mini_build, max_batch=256, max_context=1 << 20, dtype="float32")
    with pytest.raises(PreflightError, match="lower max_batch") as e:
        preflight.preflight(
            mini_build,
            Deployment(
                memory_headroom_gib=64 * MiB / GiB,
                max_batch=256,
                max_context=1 << 20,
                prefill_chunk=32,
            ),
        )
    assert f"{big['total']:,} bytes" in str(e.value) and str(mini_build) in str(e.value)


def _need(folder, dep) -> int:
    kv, act = preflight.serving_need(folder, dep)
    return kv["total"] + act["total"]


def test_shipped_deployments_pass_the_memory_check(tmp_path):
    """deploy/tb5.yaml with the real K3 (sliced for its 2 ranks, attention split), and the
    embedded default / deploy/local.yaml / the test servers' settings with the mini-K3:
    the headroom holds the KV/state and the prefill activations."""
    tb5 = load_deployment(REPO / "deploy" / "tb5.yaml")
    assert tb5.attention == "split" and tb5.size == 2 and tb5.dtype == "bfloat16"
    folder = _rank_folder(tmp_path / "tb5", real_config(), size=tb5.size)
    assert _need(folder, tb5) == 24_727_643_136 + 9_980_346_368  # KV + a 256-token chunk
    kv, act = preflight.serving_need(folder, tb5)
    # what preflight checks: the batch-join copy (15.39 GB) outgrows the 256-token chunk
    need = kvmemory.need_bytes(kv, act)["total"]
    assert need == 24_727_643_136 + 15_394_258_944 and tb5.memory_headroom_gib == 44
    assert need + 5 * GiB <= tb5.memory_headroom_gib * GiB  # 6.63 GiB beyond the model
    mini = k3dist.MINI_K3  # the embedded default's source (no manifest: whole)
    local = REPO / "deploy" / "local.yaml"
    deps = {
        "default": Deployment(),
        "local.yaml": load_deployment(local),
        "tests/serving.py": load_deployment(local, max_context=512, prefill_chunk=32, max_batch=8),
        "test_agent_api": load_deployment(local, max_context=2048, prefill_chunk=32),
    }
    needs = {name: _need(mini, dep) for name, dep in deps.items()}
    # the largest, the defaults (4096 tokens, 8 requests, chunk 256, float32): 74 MB = KV
    # 38.1 MB + activations 35.9 MB, 3.4% of the default 2 GiB
    assert needs["default"] == needs["local.yaml"] == 38_089_088 + 35_913_728
    for name, dep in deps.items():
        assert needs[name] <= needs["default"] <= dep.memory_headroom_gib * GiB / 20, name
