"""The checkpoint audit: the real K3 index (names only) and mini-K3 shards, clean
and broken one way at a time; every finding names the file and the tensor."""

from __future__ import annotations

import gc
import gzip
import json
import shutil
import struct
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from k3dist.factory import synth
from k3dist.format import layout
from k3dist.format.folder import INDEX_NAME, REAL_K3_CONFIG, REAL_K3_INDEX
from k3dist.format.sfile import CheckpointError, read_header
from k3dist.format.source import check_a_log_tail
from k3dist.pipeline import audit as audit_mod
from k3dist.pipeline.audit import NO_SHARDS, audit, to_json
from k3dist.pipeline.checkpoint import format_table, main

import numpy as np
import pytest

# the real K3's config.json and tensor index, as the package ships them (copies of
# ../shared/reference's)
REF_CONFIG, REF_INDEX = REAL_K3_CONFIG, REAL_K3_INDEX
L = layout.LAYER_PREFIX
HEADER_CHECKS = {"shard_headers", "index_vs_headers", "dtypes_shapes", "a_log_padding"}


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """One clean mini-K3 checkpoint for the module; tests that break it copy it."""
    return synth.synthesize(
        tmp_path_factory.mktemp("ckpt") / "mini", "mini", seed=0, progress=False
    )


@pytest.fixture
def broken(src, tmp_path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "mini"))


def _index(folder: Path) -> dict:
    return json.loads((folder / INDEX_NAME).read_text())


def _write_index(folder: Path, index: dict) -> None:
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2))


def _shard_of(folder: Path, name: str) -> Path:
    return folder / _index(folder)["weight_map"][name]


def _rewrite_shard(path: Path, edit, extra: bytes = b"") -> None:
    """Re-serialise a shard's header after ``edit(header_dict)``; data bytes kept,
    ``extra`` appended after them."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :] + extra)


def _data_size(path: Path) -> int:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - n


def _only(report, **expected_nonempty) -> None:
    """The report's findings are exactly the named kinds (each non-empty)."""
    kinds = {
        "missing": report.missing,
        "unexpected": report.unexpected,
        "mismatches": report.mismatches,
        "index_errors": report.index_errors,
        "shard_errors": report.shard_errors,
        "a_log": report.a_log_failures,
        "errors": report.errors,
    }
    for kind, found in kinds.items():
        assert bool(found) == (kind in expected_nonempty), (kind, found)
    assert not report.ok


# ------------------------------------------------------------------ the real index


def test_real_index_names_counts_and_bytes():
    r = audit(config=REF_CONFIG, index=REF_INDEX)
    assert r.ok, format_table(r)
    assert r.tensors == r.expected_tensors == 497_220
    assert r.expert_packed == 247_296 == 92 * 896 * 3
    assert r.counts == r.expected_counts
    assert r.counts["experts"] == 92 * 896 * 6
    assert r.missing == [] and r.unexpected == []
    assert r.total_bytes == r.index_total_size == 1_560_860_324_864
    assert sum(r.family_bytes.values()) == 1_560_860_324_864
    assert len(r.shard_bytes) == 96 and r.bytes_from == "specs"
    # Layer L in shard L+1: a MoE layer's 896 experts and its dense tensors.
    assert r.shard_tensors["model-00002-of-000096.safetensors"] == 896 * 6 + 28
    assert "total_size" in r.checks_run and "coverage" in r.checks_run
    assert r.checks_skipped == {c: NO_SHARDS for c in HEADER_CHECKS}
    assert r.a_log == {} and r.seconds < 30

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "k3dist.pipeline.checkpoint",
            "audit",
            "--json",
            "--config",
            str(REF_CONFIG),
            "--index",
            str(REF_INDEX),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    j = json.loads(out.stdout)
    assert j["ok"] is True and j["findings"] == 0
    assert (j["tensors"], j["expert_packed"], j["total_bytes"]) == (
        497_220,
        247_296,
        1_560_860_324_864,
    )
    assert j["counts"] == r.counts and j["shard_bytes"] == r.shard_bytes
    assert set(j["checks_skipped"]) == HEADER_CHECKS
    assert j["index_sha256"] == r.index_sha256


def _sparse_files_work(folder: Path) -> bool:
    probe = folder / "probe"
    with open(probe, "wb") as f:
        f.truncate(1 << 30)
    sparse = probe.stat().st_blocks * 512 < (1 << 20)
    probe.unlink()
    return sparse


@pytest.fixture
def gc_paused():
    """Building 497k header entries here (not under test) is 3x faster without GC."""
    gc.disable()
    yield
    gc.enable()


def test_real_size_headers_in_seconds(tmp_path, gc_paused):
    """96 shards with the real model's headers (75 MB of JSON, 497,220 tensors) and
    sparse data: the full header audit, A_log tails included, takes seconds."""
    if not _sparse_files_work(tmp_path):
        pytest.skip("this filesystem has no sparse files; 1.56 TB would be written")
    config = json.loads(REF_CONFIG.read_text())
    raw_index = gzip.decompress(REF_INDEX.read_bytes())
    specs = audit_mod._implied(config).specs  # == layout's: test_implied_keys_are_layouts
    by_shard: dict[str, list[str]] = {}
    for name, fname in json.loads(raw_index)["weight_map"].items():
        by_shard.setdefault(fname, []).append(name)
    for fname, names in by_shard.items():
        parts, offset = ['"__metadata__":{"format":"pt"}'], 0
        for name in names:
            s = specs[name]
            parts.append(
                f'"{name}":{{"dtype":"{s.dtype}","shape":{list(s.shape)},'
                f'"data_offsets":[{offset},{offset + s.nbytes}]}}'
            )
            offset += s.nbytes
        raw = ("{" + ",".join(parts) + "}").encode()
        with open(tmp_path / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)  # zeros: every A_log tail is clean
    shutil.copy(REF_CONFIG, tmp_path / "config.json")
    (tmp_path / INDEX_NAME).write_bytes(raw_index)
    gc.enable()  # the audit runs as a user would run it

    cpu = time.process_time()
    r = audit(tmp_path)
    cpu = time.process_time() - cpu
    assert r.ok, format_table(r)
    assert r.bytes_from == "headers" and r.checks_skipped == {}
    assert r.tensors == 497_220 and r.expert_packed == 247_296
    assert r.total_bytes == r.index_total_size == 1_560_860_324_864
    assert r.shard_bytes == {f: _data_size(tmp_path / f) for f in by_shard}
    assert r.family_bytes["experts"] == 92 * 896 * 17_547_264  # one MXFP4 expert: 17.5 MB
    assert len(r.a_log) == 69 and set(r.a_log.values()) == {"ok"}
    # CPU seconds, not wall: a scaling guard (5 ms a tensor would be 41 min) that a busy
    # machine cannot fail; the audit's wall time is benchmarks/pipeline/rehearsal.py's to report.
    assert cpu < 20, f"audit took {cpu:.1f} CPU s ({r.seconds:.1f} s wall)"


# ------------------------------------------------------------------ clean mini-K3


@pytest.mark.parametrize("which", ["mini", "real"])
def test_implied_keys_are_layouts(src, which):
    """The fast expansion of expert keys is exactly layout.source_specs, in order."""
    config = (
        json.loads((src / "config.json").read_text()) if which == "mini" else (synth.real_config())
    )
    specs = layout.source_specs(config)
    implied = audit_mod._implied(config)
    assert list(implied.specs) == [s.name for s in specs]
    for s in specs:
        got = implied.specs[s.name]
        assert (got.dtype, got.shape, got.family, got.layer) == (
            s.dtype,
            s.shape,
            s.family,
            s.layer,
        )
    assert dict(implied.counts) == dict(Counter(s.family for s in specs))


def test_clean_mini(src):
    r = audit(src)
    assert r.ok, format_table(r)
    config = json.loads((src / "config.json").read_text())
    specs = layout.source_specs(config)
    assert r.counts == dict(Counter(s.family for s in specs)) == r.expected_counts
    assert r.tensors == len(specs) == len(_index(src)["weight_map"])
    assert r.expert_packed == sum(
        s.family == "experts" and s.name.endswith("weight_packed") for s in specs
    )
    assert r.bytes_from == "headers"
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert sorted(r.shard_bytes) == shards
    assert r.shard_bytes == {f: _data_size(src / f) for f in shards}
    assert r.total_bytes == r.index_total_size == sum(s.nbytes for s in specs)
    kda = layout.kda_layers(layout.text_config(config))
    assert set(r.a_log) == kda and set(r.a_log.values()) == {"ok"}
    assert HEADER_CHECKS <= set(r.checks_run) and "total_size" in r.checks_run
    assert r.checks_skipped == {}
    table = format_table(r)
    assert "result: OK" in table and "every tail is zero" in table
    assert json.loads(to_json(r))["ok"] is True


def test_index_only_bytes_match_headers(src, tmp_path):
    """Without shards: per-shard bytes implied via the index equal the real ones;
    a gzipped index is read too."""
    only = tmp_path / "names"
    only.mkdir()
    shutil.copy(src / "config.json", only / "cfg.json")
    raw = (src / INDEX_NAME).read_bytes()
    (only / "index.json.gz").write_bytes(gzip.compress(raw))
    r = audit(config=only / "cfg.json", index=only / "index.json.gz")
    assert r.ok and r.bytes_from == "specs"
    assert r.shard_bytes == audit(src).shard_bytes
    assert r.checks_skipped == {c: NO_SHARDS for c in HEADER_CHECKS}
    assert r.a_log == {}
    assert "skipped: a_log_padding (no shard files" in format_table(r)


def test_cli_exit_codes(src, broken, tmp_path, capsys):
    main(["audit", str(src)])  # ok: returns
    assert "result: OK" in capsys.readouterr().out
    (broken / "model-00003-of-000009.safetensors").unlink()
    with pytest.raises(SystemExit) as e:
        main(["audit", "--json", str(broken)])
    assert e.value.code == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False
    with pytest.raises(SystemExit) as e:
        main(["audit", str(tmp_path / "nothing")])
    assert e.value.code == 2
    assert "not a folder" in capsys.readouterr().err


# ------------------------------------------------------------------ broken inputs


def test_truncated_shard(broken):
    shard = _shard_of(broken, f"{L}1.input_layernorm.weight")
    shard.write_bytes(shard.read_bytes()[:-100])
    r = audit(broken)
    _only(r, shard_errors=True)
    msg = r.shard_errors[shard.name]
    assert str(shard) in msg and "truncated" in msg and f"'{L}1." in msg
    assert 1 not in r.a_log and r.a_log[0] == r.a_log[2] == "ok"  # the rest is audited
    assert "total_size" in r.checks_skipped
    assert "UNREADABLE" in format_table(r)


def test_missing_shard_file(broken):
    shard = _shard_of(broken, f"{L}2.input_layernorm.weight")
    shard.unlink()
    r = audit(broken)
    _only(r, shard_errors=True)
    assert list(r.shard_errors) == [shard.name]
    assert str(shard) in r.shard_errors[shard.name]
    assert "missing" in r.shard_errors[shard.name]
    assert len(r.shard_bytes) == 8


def test_index_names_tensor_absent_from_shard(broken):
    name = f"{L}2.post_attention_layernorm.weight"
    shard = _shard_of(broken, name)
    _rewrite_shard(shard, lambda h: h.pop(name))
    r = audit(broken)
    _only(r, index_errors=True)
    assert len(r.index_errors) == 1
    assert str(shard) in r.index_errors[0] and repr(name) in r.index_errors[0]
    assert "does not hold it" in r.index_errors[0]
    assert "total_size" in r.checks_skipped  # the headers lack its bytes: said once


def test_wrong_dtype(broken):
    name = f"{L}0.input_layernorm.weight"  # BF16 -> F16: same bytes, other dtype
    shard = _shard_of(broken, name)
    _rewrite_shard(shard, lambda h: h[name].update(dtype="F16"))
    r = audit(broken)
    _only(r, mismatches=True)
    assert len(r.mismatches) == 1
    msg = r.mismatches[0]
    assert str(shard) in msg and repr(name) in msg and "F16[64]" in msg and "BF16[64]" in msg


def test_wrong_shape(broken):
    name = f"{L}0.mlp.gate_proj.weight"  # [128, 64] stored as [64, 128]
    shard = _shard_of(broken, name)
    _rewrite_shard(shard, lambda h: h[name].update(shape=[64, 128]))
    r = audit(broken)
    _only(r, mismatches=True)
    assert len(r.mismatches) == 1
    msg = r.mismatches[0]
    assert str(shard) in msg and repr(name) in msg
    assert "BF16[64, 128]" in msg and "implies BF16[128, 64]" in msg


def test_nonzero_a_log_tail(broken):
    config = json.loads((broken / "config.json").read_text())
    heads = config["text_config"]["linear_attn_config"]["num_heads"]
    name = f"{L}1.self_attn.A_log"
    shard = _shard_of(broken, name)
    t = read_header(shard).tensors[name]
    assert t.shape[0] > heads
    with open(shard, "r+b") as f:
        f.seek(t.start + 4 * (heads + 2))
        f.write(np.float32(0.5).tobytes())
    r = audit(broken)
    _only(r, a_log=True)
    assert list(r.a_log_failures) == [1]
    msg = r.a_log[1]
    assert "layer 1" in msg and str(shard) in msg and repr(name) in msg
    assert f"index {heads + 2}" in msg and "0.5" in msg
    assert r.a_log[0] == r.a_log[2] == r.a_log[4] == "ok"
    with pytest.raises(CheckpointError, match="layer 1"):
        check_a_log_tail(t, heads)


def test_unexpected_extra_key(broken):
    name = f"{L}0.self_attn.extra_proj.weight"
    shard = _shard_of(broken, f"{L}0.input_layernorm.weight")
    end = _data_size(shard)

    def add(h):
        h[name] = {"dtype": "BF16", "shape": [4], "data_offsets": [end, end + 8]}

    _rewrite_shard(shard, add, extra=bytes(8))
    index = _index(broken)
    index["weight_map"][name] = shard.name
    index["metadata"]["total_size"] += 8
    _write_index(broken, index)
    r = audit(broken)
    _only(r, unexpected=True)
    assert r.unexpected == [name]
    assert r.total_bytes == r.index_total_size  # headers hold the extra 8 bytes
    assert name in format_table(r)


def test_shard_holds_tensor_the_index_does_not_list(broken):
    name = f"{L}3.stray.weight"
    shard = _shard_of(broken, f"{L}3.input_layernorm.weight")
    end = _data_size(shard)
    _rewrite_shard(
        shard,
        lambda h: h.update({name: {"dtype": "U8", "shape": [8], "data_offsets": [end, end + 8]}}),
        bytes(8),
    )
    r = audit(broken)
    _only(r, index_errors=True)
    assert len(r.index_errors) == 1
    assert str(shard) in r.index_errors[0] and repr(name) in r.index_errors[0]
    assert "does not place there" in r.index_errors[0]


def test_missing_key(broken):
    name = f"{L}5.post_attention_layernorm.weight"
    shard = _shard_of(broken, name)
    _rewrite_shard(shard, lambda h: h.pop(name))
    index = _index(broken)
    del index["weight_map"][name]
    index["metadata"]["total_size"] -= 64 * 2
    _write_index(broken, index)
    r = audit(broken)
    _only(r, missing=True)
    assert r.missing == [name]
    assert r.counts["norm"] == r.expected_counts["norm"] - 1
    assert f"missing keys (1):\n  {name}" in format_table(r)


def test_one_run_names_every_problem(broken):
    """Findings accumulate: a truncated shard, a wrong dtype and a bad A_log tail
    in three different shards are all reported by one audit."""
    s1 = _shard_of(broken, f"{L}1.input_layernorm.weight")
    s1.write_bytes(s1.read_bytes()[:-4])
    wrong = f"{L}4.input_layernorm.weight"  # same shard as the A_log: the slow path
    _rewrite_shard(_shard_of(broken, wrong), lambda h: h[wrong].update(dtype="F16"))
    name = f"{L}4.self_attn.A_log"
    t = read_header(_shard_of(broken, name)).tensors[name]
    with open(t.path, "r+b") as f:
        f.seek(t.end - 4)
        f.write(np.float32(-1.0).tobytes())
    r = audit(broken)
    _only(r, shard_errors=True, mismatches=True, a_log=True)
    assert list(r.shard_errors) == [s1.name]
    assert repr(wrong) in r.mismatches[0]
    assert list(r.a_log_failures) == [4] and "layer 4" in r.a_log[4]
    assert r.findings == 3
    assert "FAILED: 3 findings" in format_table(r)
