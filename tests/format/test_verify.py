"""A rank folder whose bytes no longer match its manifest is refused before serving,
naming the file, the tensor and the fix; stamps keep restarts from re-hashing."""

from __future__ import annotations

import json
import os
import shutil
import time
from types import SimpleNamespace

from k3dist.format import layout, placement, verify
from k3dist.format.sfile import read_header
from k3dist.pipeline import rank_files, slicing
from k3dist.serve import loader

import pytest
from util import failed_ranks, mlx_launch

LAYER = "model-layer-003.safetensors"


@pytest.fixture(scope="module")
def ranks2(mini_build, tmp_path_factory):
    out = tmp_path_factory.mktemp("vranks")
    tc = layout.text_config(json.loads((mini_build / "config.json").read_text()))
    moe = [i for i in range(tc["num_hidden_layers"]) if layout.is_moe_layer(tc, i)]
    plc = placement.contiguous(tc["num_experts"], 2, moe)
    for r in range(2):
        slicing.slice_rank(mini_build, out / f"rank{r}", r, 2, plc, progress=False)
    return out


@pytest.fixture
def rank1(ranks2, tmp_path):
    """A private copy of rank 1's folder, stamped where it now lives (a copy has new
    inodes: its first verification hashes every file once)."""
    dst = tmp_path / "rank1"
    shutil.copytree(ranks2 / "rank1", dst)
    m = _manifest(dst)
    assert len(verify.verify_folder(dst, m).hashed) == len(m["files"])
    return dst


def _manifest(folder) -> dict:
    return json.loads((folder / "k3dist.json").read_text())


def _corrupt_middle(path, n: int = 4096) -> list[str]:
    """Overwrite ``n`` bytes in the middle of the data keeping the size; returns the
    tensors whose bytes changed."""
    h = read_header(path)
    mid = h.data_offset + (h.file_size - h.data_offset) // 2
    with open(path, "r+b") as f:
        f.seek(mid)
        old = f.read(n)
        f.seek(mid)
        f.write(bytes(b ^ 0xFF for b in old))
    assert path.stat().st_size == h.file_size
    return [t.name for t in h.tensors.values() if t.start < mid + n and t.end > mid]


def test_slicer_stamps_every_file(ranks2):
    for r in range(2):
        m = _manifest(ranks2 / f"rank{r}")
        assert m["identity"]["format_version"] == rank_files.FORMAT_VERSION == 3
        report = verify.verify_folder(ranks2 / f"rank{r}", m, "stamp")
        assert report.hashed == [] and report.bytes_hashed == 0
        # the manifest's digests are the files' own: a full check passes
        full = verify.verify_folder(ranks2 / f"rank{r}", m, "full")
        assert sorted(full.hashed) == sorted(m["files"])
        assert full.bytes_hashed == sum(f["bytes"] for f in m["files"].values())


def test_overwrite_in_place_refused_in_stamp_mode(rank1, mini_build):
    damaged = _corrupt_middle(rank1 / LAYER)
    assert damaged
    with pytest.raises(verify.VerifyError) as e:
        loader.check_rank_folder(rank1, 1, 2)  # the default mode: stamp
    msg = str(e.value)
    assert f"{rank1 / LAYER}: tensor {damaged[0]!r}" in msg
    assert "will not be served" in msg
    assert (
        f"python slicing/rank_split.py --rank 1 --size 2 --build {mini_build.resolve()} "
        f"--out {rank1}" in msg
    )
    # the damaged file lost its stamp, the others kept theirs: still refused next time
    assert LAYER not in verify.read_stamp(rank1)
    with pytest.raises(verify.VerifyError, match=damaged[0]):
        verify.verify_folder(rank1, _manifest(rank1))


def test_overwrite_across_tensors_names_each(rank1):
    h = read_header(rank1 / LAYER)
    t = sorted(h.tensors.values(), key=lambda t: t.start)[3]
    with open(rank1 / LAYER, "r+b") as f:  # the last byte of one tensor, first of next
        f.seek(t.end - 1)
        f.write(b"\xa5\x5a")
    nxt = min((u for u in h.tensors.values() if u.start == t.end), key=lambda u: u.start)
    with pytest.raises(verify.VerifyError) as e:
        verify.verify_folder(rank1, _manifest(rank1), "full")
    assert repr(t.name) in str(e.value) and repr(nxt.name) in str(e.value)


def test_header_damage_is_named(rank1):
    path = rank1 / LAYER
    raw = path.read_bytes()
    i = raw.index(b'"dtype"')
    path.write_bytes(raw[:i] + b'"DTYPE"' + raw[i + 7 :])
    with pytest.raises(verify.VerifyError, match=f"{LAYER}: the safetensors header"):
        verify.verify_folder(rank1, _manifest(rank1))


def test_full_mode_catches_what_a_stamp_cannot(rank1):
    """Content changed under an unchanged stat (bit rot; or a stamp rewritten): stamp
    mode trusts the file, full mode hashes it and refuses."""
    path = rank1 / LAYER
    st = path.stat()
    damaged = _corrupt_middle(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime restored; ctime cannot be
    m = _manifest(rank1)
    stamps = verify.read_stamp(rank1)
    stamps[LAYER] = verify.stamp_entry(path, m["files"][LAYER]["sha256"])
    verify.write_stamp(rank1, stamps)
    assert verify.verify_folder(rank1, m, "stamp").hashed == []
    with pytest.raises(verify.VerifyError, match=f"tensor {damaged[0]!r}"):
        loader.check_rank_folder(rank1, 1, 2, verify="full")


def test_restored_mtime_still_caught_in_stamp_mode(rank1):
    path = rank1 / LAYER
    st = path.stat()
    time.sleep(0.01)
    damaged = _corrupt_middle(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_size == st.st_size
    with pytest.raises(verify.VerifyError, match=f"tensor {damaged[0]!r}"):
        loader.check_rank_folder(rank1, 1, 2)  # ctime moved: hashed again


def test_stamp_hashes_only_changed_files(rank1):
    m = _manifest(rank1)
    assert verify.verify_folder(rank1, m).hashed == []
    touched = rank1 / "model-layer-001.safetensors"
    os.utime(touched, ns=(1, 1))  # new mtime, same bytes
    replaced = rank1 / "tokenizer.json"  # same bytes, new inode
    shutil.copy(replaced, rank1 / "t.tmp")
    os.replace(rank1 / "t.tmp", replaced)
    report = verify.verify_folder(rank1, m)
    assert sorted(report.hashed) == sorted([touched.name, replaced.name])
    assert report.bytes_hashed == touched.stat().st_size + replaced.stat().st_size
    assert report.stamp == "written"
    again = verify.verify_folder(rank1, m)
    assert again.hashed == [] and again.stamp == "unchanged"
    (rank1 / verify.STAMP).unlink()  # no stamp: every file once
    assert len(verify.verify_folder(rank1, m).hashed) == len(m["files"])


def test_threads_agree(rank1):
    m = _manifest(rank1)
    a = verify.verify_folder(rank1, m, "full", threads=1)
    b = verify.verify_folder(rank1, m, "full", threads=3)
    assert a.bytes_hashed == b.bytes_hashed and sorted(a.hashed) == sorted(b.hashed)
    damaged = _corrupt_middle(rank1 / LAYER)
    for n in (1, 3):
        with pytest.raises(verify.VerifyError, match=f"tensor {damaged[0]!r}"):
            verify.verify_folder(rank1, m, "full", threads=n)


def test_size_mode_checks_sizes_only(rank1):
    _corrupt_middle(rank1 / LAYER)
    m, _ = loader.check_rank_folder(rank1, 1, 2, verify="size")  # opted out: served
    assert m["verify"]["mode"] == "size" and m["verify"]["hashed"] == []
    with open(rank1 / LAYER, "ab") as f:
        f.write(b"\0")
    with pytest.raises(verify.CheckpointError, match=f"{LAYER} has .* bytes"):
        loader.check_rank_folder(rank1, 1, 2, verify="size")


def test_old_manifest_clear_error(rank1):
    mpath = rank1 / "k3dist.json"
    m = _manifest(rank1)
    m["identity"]["format_version"] = 1
    for meta in m["files"].values():
        meta.pop("tensors", None)
        meta.pop("header_sha256", None)
    mpath.write_text(json.dumps(m))
    for mode in ("stamp", "full"):
        with pytest.raises(verify.VerifyError, match="format 1 .* no per-tensor digests") as e:
            loader.check_rank_folder(rank1, 1, 2, verify=mode)
        assert "--verify size" in str(e.value) and "rank_split.py --rank 1" in str(e.value)
    assert loader.check_rank_folder(rank1, 1, 2, verify="size")[0]["rank"] == 1


def test_two_ranks_refuse_a_corrupted_rank1(ranks2, tmp_path):
    """Through mlx.launch: rank 1 refuses before loading, naming file and tensor; rank 0
    (in the start-up handshake) fails too; nothing is left running."""
    for r in range(2):
        shutil.copytree(ranks2 / f"rank{r}", tmp_path / f"rank{r}")
    damaged = _corrupt_middle(tmp_path / "rank1" / LAYER)
    t0 = time.perf_counter()
    res = mlx_launch(
        2,
        "launch/generate.py",
        "--rank-dir",
        str(tmp_path / "rank{rank}"),
        "--max-tokens",
        "2",
        timeout=120,
    )
    elapsed = time.perf_counter() - t0
    assert failed_ranks(res) == {0, 1}, res.stderr[-3000:]
    assert f"{tmp_path / 'rank1' / LAYER}: tensor {damaged[0]!r}" in res.stderr
    assert '"tokens"' not in res.stdout  # no rank generated anything
    assert elapsed < 90


def test_server_never_serves_a_corrupted_rank1(ranks2, tmp_path):
    """launch/serve.py on two ranks: /health never answers, every process ends, the log
    names file and tensor."""
    import subprocess
    import urllib.request

    from util import REPO, feed_stdin, free_base_port, launch_cmd

    for r in range(2):
        shutil.copytree(ranks2 / f"rank{r}", tmp_path / f"rank{r}")
    damaged = _corrupt_middle(tmp_path / "rank1" / LAYER)
    port = free_base_port(1)
    cmd = launch_cmd(
        2,
        "launch/serve.py",
        "--rank-dir",
        str(tmp_path / "rank{rank}"),
        "--port",
        str(port),
        "--no-warmup",
    )
    t0 = time.perf_counter()
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, HOME=str(tmp_path)),
        )
        feed_stdin(proc.stdin)
        served = False
        while proc.poll() is None and time.perf_counter() - t0 < 120:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    served = True
            except OSError:
                pass
            time.sleep(0.2)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            pytest.fail(f"still running after 120 s:\n{(tmp_path / 'log').read_text()[-3000:]}")
    out = (tmp_path / "log").read_text()
    assert not served
    assert f"{tmp_path / 'rank1' / LAYER}: tensor {damaged[0]!r}" in out
    assert "will not be served" in out
    assert failed_ranks(SimpleNamespace(stdout=out, stderr="")) == {0, 1}, out[-3000:]


def test_config_key_and_command_line(rank1, capsys):
    from k3dist.config.deployment import load_deployment

    assert load_deployment(None).verify == "stamp"
    assert load_deployment(None, verify="full").verify == "full"
    with pytest.raises(ValueError, match="verify must be stamp, full or size"):
        load_deployment(None, verify="fast")
    verify.main([str(rank1), "--threads", "1"])  # --mode full by default
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "full" and len(report["hashed"]) == len(_manifest(rank1)["files"])
    damaged = _corrupt_middle(rank1 / LAYER)
    with pytest.raises(SystemExit, match=f"error: .*tensor {damaged[0]!r}"):
        verify.main([str(rank1)])
