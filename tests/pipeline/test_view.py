"""The base build read from the source and the calibration student quantized in memory
(k3dist.pipeline.view, k3dist.pipeline.student), against the builds they replace, written on
k3dist/data/mini-k3: every tensor's bytes, the teacher's states, calibration's scores and routes,
and the graded build's files are the same; the graded build written straight into rank
folders (k3dist.pipeline.direct) equals its slices."""

from __future__ import annotations

import json
from pathlib import Path

from k3dist import MINI_K3
from k3dist.format import manifest, verify
from k3dist.format.classes import CLASSES
from k3dist.format.sfile import mx_to_bytes, read_bytes, sha256_file
from k3dist.pipeline import (
    calibrate,
    calibtext,
    convert,
    direct,
    diskplan,
    dwq,
    profiles,
    promote,
    slicing,
    stage_graph,
    student,
    teacher,
    view,
)

import mlx.core as mx
import numpy as np
import pytest

MINI = MINI_K3


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The pipeline's plan for the mini, its base and student written the old way, the
    token set and the teacher."""
    tmp = tmp_path_factory.mktemp("view")
    a = stage_graph.Args(src=str(MINI), out=str(tmp), target_bpw=3)
    config, index, _ = diskplan.read_config_index(a)
    plan = diskplan.make_plan(a, diskplan.account(a, config, index))
    ne = {c: v["format"] for c, v in plan["nonexpert"].items() if c in CLASSES}
    assert any(f != "bf16" for f in ne.values())  # the plan quantizes non-experts
    base = convert.convert(MINI, tmp / "base", nonexpert=ne, progress=False)
    lo = plan["lo"]["format"]
    written = promote.grade(base, tmp / "student", {}, 0, lo, progress=False)
    calibtext.make(MINI, tmp / "tokens.npz", None, 4, 32)
    tokens = teacher.read_tokens(tmp / "tokens.npz")
    teacher.run(base, tokens, tmp / "teacher", progress=False)
    return tmp, a, plan, ne, base, written, tokens


def test_source_view_is_the_base_build_byte_for_byte(built):
    _, _, _, ne, base, _, _ = built
    v, b = view.SourceView(MINI, ne), view.BuildFolder(base)
    assert v.config == b.config and v.index == b.index
    assert v.manifest["build_hash"] == b.manifest["build_hash"]
    assert v.files() == b.files()
    arrays = v.all_arrays()
    n = 0
    for f in b.files():
        hb, hv = b.header(f), v.header(f)
        assert list(hv.tensors) == list(hb.tensors), f  # same order in the file
        for name, t in hb.tensors.items():
            tv = hv.tensors[name]
            assert (tv.dtype, tv.shape, tv.start, tv.end) == (
                t.dtype,
                t.shape,
                t.start - hb.data_offset,
                t.end - hb.data_offset,
            ), name
            data = read_bytes(t)
            assert b"".join(v.chunks(tv)) == data, name  # what grade reads
            assert mx_to_bytes(arrays[name]) == data, name  # what a layer stream reads
            n += 1
    assert n == len(b.index)
    # experts are the source's MXFP4 bytes; non-experts in the plan's formats
    assert any(k.endswith("switch_mlp.gate_proj.weight") for k in arrays)
    assert any(k.endswith("q_proj.scales") or k.endswith("qkv_proj.scales") for k in arrays)


def test_lo_view_is_the_written_student(built):
    _, _, plan, ne, _, written, _ = built
    lv = student.LoView(view.SourceView(MINI, ne), plan["lo"]["format"])
    s = view.BuildFolder(written)
    assert lv.config == s.config and set(lv.index) == set(s.index)
    assert lv.manifest["build_hash"] == s.manifest["build_hash"]
    arrays = lv.arrays("")
    assert set(arrays) == set(s.index)
    for name, f in s.index.items():
        assert mx_to_bytes(arrays[name]) == mx_to_bytes(mx.load(str(written / f))[name]), name


def test_teacher_and_calibration_from_the_source_equal_the_written_builds(built):
    tmp, _, plan, ne, base, written, tokens = built
    v = view.SourceView(MINI, ne)
    teacher.run(v, tokens, tmp / "teacher-view", progress=False)
    files = sorted(p.name for p in (tmp / "teacher").glob("*.safetensors"))
    assert files and files == sorted(p.name for p in (tmp / "teacher-view").glob("*.safetensors"))
    for name in files:
        assert sha256_file(tmp / "teacher" / name) == sha256_file(tmp / "teacher-view" / name)
    calibrate.calibrate(written, base, tmp / "teacher", tokens, tmp / "cal", progress=False)
    lv = student.LoView(v, plan["lo"]["format"])
    calibrate.calibrate(lv, v, tmp / "teacher", tokens, tmp / "cal-view", progress=False)
    names = sorted(p.name for p in (tmp / "cal").glob("*.npz"))
    assert "scores-taylor.npz" in names and "routes.npz" in names
    for name in names:
        x, y = np.load(tmp / "cal" / name), np.load(tmp / "cal-view" / name)
        assert sorted(x) == sorted(y)
        for k in x:
            assert np.array_equal(x[k], y[k]), (name, k)  # same numbers, not close ones


class _CountingView:
    """A view that counts which prefixes a layer stream asks it for."""

    def __init__(self, v):
        self.v, self.asked = v, []

    def __getattr__(self, name):
        return getattr(self.v, name)

    def arrays(self, prefix: str | tuple[str, ...]) -> dict[str, mx.array]:
        self.asked.append(prefix)
        return self.v.arrays(prefix)


def test_a_stream_reads_each_unit_once_a_use_and_a_released_one_is_nan(built):
    """The teacher makes each unit of a view once (at K3's counts a unit costs ~0.1 s
    and there are 94): not when the stream starts, not when a layer is released. A
    released layer's weights are NaN until read again, so a use that skipped the read
    cannot look right."""
    from k3dist.pipeline import stream

    tmp, _, _, ne, _, _, tokens = built
    cv = _CountingView(view.SourceView(MINI, ne))
    teacher.run(cv, tokens, tmp / "teacher-count", progress=False)
    asked = [(p,) if isinstance(p, str) else p for p in cv.asked]
    layers = [p for call in asked for p in call if ".layers." in p]
    n = len(layers)
    assert n >= 4 and sorted(layers) == sorted(set(layers))  # each layer once
    assert len(asked) == len(set(asked))  # and nothing else twice
    head = [call for call in asked if "language_model.model.norm." in call]
    assert len(head) == 1 and len(head[0]) > 1  # the head's modules: one unit, one call
    for name in sorted(p.name for p in (tmp / "teacher").glob("*.safetensors")):
        assert sha256_file(tmp / "teacher" / name) == sha256_file(tmp / "teacher-count" / name)

    st = stream.LayerStream(view.SourceView(MINI, ne))
    before = {k: np.array(v) for k, v in _params(st.layer(1))}
    st.release_layer(1)
    floats = [v for k, v in _params(st.text.layers[1]) if mx.issubdtype(v.dtype, mx.floating)]
    assert floats and all(bool(mx.isnan(v).all()) for v in floats)
    after = {k: np.array(v) for k, v in _params(st.layer(1))}
    assert before.keys() == after.keys()
    assert all(np.array_equal(before[k], after[k]) for k in before)


def _params(module):
    from mlx.utils import tree_flatten

    return tree_flatten(module.parameters())


def _graded_inputs(built) -> tuple[dict, Path, list[Path]]:
    """convert_profile's graded arguments (calibration from the written builds), the graded
    build written from the base build and its slices (made once for this module)."""
    tmp, a, _, _, base, _, tokens = built
    cal = tmp / "cal-g"
    if not (cal / "calibrate.json").exists():
        calibrate.calibrate(tmp / "student", base, tmp / "teacher", tokens, cal, progress=False)
    kw = dict(
        scores=cal / "scores-taylor.npz",
        routes=cal / "routes.npz",
        plan=diskplan.make_plan(a, diskplan.account(a, *diskplan.read_config_index(a)[:2])),
        progress=False,
    )
    g1 = profiles.convert_profile(MINI, tmp / "g1", "graded", mxfp4_dir=base, **kw)
    sliced = slicing.slice_all(g1, str(tmp / "sliced" / "rank{rank}"), 2, progress=False)
    return kw, g1, sliced


def _same_rank_folders(sliced: list[Path], direct: list[Path]) -> None:
    """File for file the same bytes; only k3dist.json names another input folder."""
    for r, (x, y) in enumerate(zip(sliced, direct, strict=True)):
        names = sorted(p.name for p in x.iterdir())
        assert names == sorted(p.name for p in y.iterdir())
        assert "model-layer-001.safetensors" in names
        for name in names:
            if name not in ("k3dist.json", ".k3dist-verified.json"):
                assert sha256_file(x / name) == sha256_file(y / name), (r, name)
        mx_, my = (json.loads((p / "k3dist.json").read_text()) for p in (x, y))
        assert {k for k in mx_ if mx_[k] != my.get(k)} <= {"build", "seconds"}


def test_graded_from_the_source_equals_graded_from_the_base_build_and_its_slices(built):
    tmp, _, _, ne, _, _, _ = built
    kw, g1, sliced = _graded_inputs(built)
    g2 = profiles.convert_profile(MINI, tmp / "g2", "graded", base=view.SourceView(MINI, ne), **kw)
    f1 = sorted(p.name for p in Path(g1).iterdir() if p.name != "k3dist.json")
    assert f1 == sorted(p.name for p in Path(g2).iterdir() if p.name != "k3dist.json")
    for name in f1:
        assert sha256_file(g1 / name) == sha256_file(g2 / name), name
    with pytest.raises(ValueError, match="base build view"):
        profiles.convert_profile(MINI, tmp / "g3", "graded", base=view.SourceView(MINI), **kw)
    # written straight into the rank folders (k3dist.pipeline.direct): what slicing the
    # written graded build gives
    direct = profiles.convert_profile(
        MINI,
        tmp / "scratch",
        "graded",
        base=view.SourceView(MINI, ne),
        rank_pattern=str(tmp / "direct" / "rank{rank}"),
        **kw,
    )
    assert not (tmp / "scratch").exists()  # its one graded file at a time, then deleted
    _same_rank_folders(sliced, direct)


def test_direct_rank_writes_resume_after_a_stop(built, monkeypatch):
    tmp, _, _, ne, _, _, _ = built
    kw, _, sliced = _graded_inputs(built)
    made = []
    drop = direct.GradedFiles.drop

    def drop_then_stop(self):  # stop after the third graded file went into the ranks
        if self.current is not None:
            made.append(self.current)
        drop(self)
        if len(made) == 3:
            raise RuntimeError("stopped")

    monkeypatch.setattr(direct.GradedFiles, "drop", drop_then_stop)
    args = (MINI, tmp / "scratch-r", "graded")
    pattern = str(tmp / "resumed" / "rank{rank}")
    with pytest.raises(RuntimeError, match="stopped"):
        profiles.convert_profile(*args, base=view.SourceView(MINI, ne), rank_pattern=pattern, **kw)
    monkeypatch.undo()
    ranks = [tmp / "resumed" / f"rank{r}" for r in (0, 1)]
    assert not any((r / "k3dist.json").exists() for r in ranks)  # unfinished
    assert all((r / made[0]).exists() for r in ranks)  # sliced before the stop
    resumed = profiles.convert_profile(
        *args, base=view.SourceView(MINI, ne), rank_pattern=pattern, **kw
    )
    _same_rank_folders(sliced, resumed)


DWQ_CFG = dwq.DWQConfig(steps=4, lr=1e-4, batch=2, valid_windows=2, eval_every=2)


def _dwq_sliced(built) -> list[Path]:
    """Today's path for ``--dwq``: the written graded build, DWQ'd into a written build,
    sliced (made once for this module)."""
    tmp, _, _, _, base, _, tokens = built
    out = tmp / "dwq-sliced"
    if not (out / "rank1" / "k3dist.json").exists():
        _, g1, _ = _graded_inputs(built)
        d = dwq.dwq(tmp / "teacher", g1, tokens, tmp / "dwq-build", DWQ_CFG, progress=False)
        slicing.slice_all(d, str(out / "rank{rank}"), 2, progress=False)
    return [out / f"rank{r}" for r in (0, 1)]


def _direct_ranks(built, name: str) -> list[Path]:
    """The graded build written straight into rank folders ``tmp/name/rank{rank}``."""
    tmp, _, _, ne, _, _, _ = built
    kw, _, _ = _graded_inputs(built)
    pattern = str(tmp / name / "rank{rank}")
    return profiles.convert_profile(
        MINI,
        tmp / f"{name}-scratch",
        "graded",
        base=view.SourceView(MINI, ne),
        rank_pattern=pattern,
        **kw,
    )


def _dwq_into(built, ranks: list[Path], scratch: str) -> Path:
    tmp, _, _, ne, _, _, tokens = built
    student_ = dwq.graded_view(view.SourceView(MINI, ne), ranks)
    return dwq.dwq(
        tmp / "teacher",
        student_,
        tokens,
        tmp / scratch,
        DWQ_CFG,
        progress=False,
        ranks=ranks,
    )


def test_dwq_into_the_rank_folders_equals_slicing_the_dwq_build(built):
    sliced = _dwq_sliced(built)
    ranks = _direct_ranks(built, "dwq-direct")
    before = {r: sha256_file(r / "model-layer-001.safetensors") for r in ranks}
    out = _dwq_into(built, ranks, "dwq-scratch")
    # the student read from the source (graded_view) and the rank files rewritten in place
    # are the rank folders slicing the written DWQ build gives, byte for byte
    _same_rank_folders(sliced, ranks)
    assert all(sha256_file(r / "model-layer-001.safetensors") != before[r] for r in ranks)
    blocks = json.loads((out / "k3dist.json").read_text())["dwq"]["blocks"]
    assert blocks and all(b["valid_after"] < b["valid_before"] for b in blocks)  # trained
    for r in ranks:  # what a serving rank checks first: stamped as written, and every hash
        m = manifest.verify(r, "rank")
        assert verify.verify_folder(r, m).hashed == []
        verify.verify_folder(r, m, "full")
        assert not (r / ".k3dist-progress.json").exists()
    # run again: every rank folder is the DWQ build's, nothing to do
    assert _dwq_into(built, ranks, "dwq-scratch") == out


def test_dwq_rank_rewrites_resume_after_a_stop(built, monkeypatch):
    sliced = _dwq_sliced(built)
    ranks = _direct_ranks(built, "dwq-resumed")
    done = []
    reslice = slicing.BuildSlicer.reslice

    def reslice_then_stop(self, fname, new):  # stop with block 1's file in rank 0 only
        reslice(self, fname, new)
        done.append((self.rank, fname))
        if len(done) == 3:
            raise RuntimeError("stopped")

    monkeypatch.setattr(slicing.BuildSlicer, "reslice", reslice_then_stop)
    with pytest.raises(RuntimeError, match="stopped"):
        _dwq_into(built, ranks, "dwq-scratch-r")
    monkeypatch.undo()
    assert done[2][0] == 0 and done[2][1] != done[0][1]
    assert not any((r / "k3dist.json").exists() for r in ranks)  # journals of the DWQ build
    resumed = _dwq_into(built, ranks, "dwq-scratch-r")
    _same_rank_folders(sliced, ranks)
    assert (resumed / "k3dist.json").exists()
