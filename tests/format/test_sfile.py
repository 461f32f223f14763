"""StreamWriter's digests, computed on threads of their own, against hashlib over the
bytes on disk: the file's, the header's, each tensor's. A header's checks, entry by
entry; ``read_parts``' bytes against the file's."""

import hashlib
import json
import os
import struct

from k3dist.format.sfile import (
    CheckpointError,
    OpenFiles,
    StreamWriter,
    TensorInfo,
    read_bytes,
    read_header,
    read_parts,
    sha256_file,
)

import numpy as np
import pytest


def _entries(rng):
    # sizes across the 1 MiB batching line: empty, tiny, 2 KiB (the GIL line), large
    sizes = [0, 3, 2048, 5, 1 << 20, 7, 3 << 20, 1]
    return [(f"t{i}", "U8", (n,)) for i, n in enumerate(sizes)], [
        rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes
    ]


@pytest.mark.parametrize("split", [1, 4096, 1 << 19])
def test_digests_equal_hashlib_over_the_file(tmp_path, split):
    rng = np.random.default_rng(split)
    entries, data = _entries(rng)
    path = tmp_path / "a.safetensors"
    with StreamWriter(path, entries, {"format": "mlx"}) as w:
        for (name, _, _), b in zip(entries, data, strict=True):
            # mixed chunk types: bytes, bytearray and memoryview (frozen before hashing)
            parts = [b[i : i + split] for i in range(0, len(b), split)] or [b""]
            w.write(
                name,
                [
                    bytearray(p) if k % 3 == 1 else memoryview(p) if k % 3 == 2 else p
                    for k, p in enumerate(parts)
                ],
            )
    assert w.sha256 == sha256_file(path)
    h = read_header(path)
    head = path.read_bytes()[: h.data_offset]
    assert w.header_sha256 == hashlib.sha256(head).hexdigest()
    assert w.tensor_sha256 == {
        n: hashlib.sha256(read_bytes(t)).hexdigest() for n, t in h.tensors.items()
    }
    assert [read_bytes(h.tensors[n]) for n, _, _ in entries] == data


def test_no_digests_same_bytes(tmp_path):
    entries, data = _entries(np.random.default_rng(0))
    with StreamWriter(tmp_path / "a.safetensors", entries) as a:
        for (name, _, _), b in zip(entries, data, strict=True):
            a.write(name, b)
    with StreamWriter(tmp_path / "b.safetensors", entries, digests=False) as b_:
        for (name, _, _), b in zip(entries, data, strict=True):
            b_.write(name, b)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    assert b_.sha256 is None and b_.tensor_sha256 == {}


def test_abort_leaves_nothing(tmp_path):
    entries, data = _entries(np.random.default_rng(1))
    path = tmp_path / "a.safetensors"
    with pytest.raises(RuntimeError, match="header promised"):
        with StreamWriter(path, entries) as w:
            w.write("t0", data[0])
            w.write("t1", data[1] + b"x")
    assert not path.exists() and not path.with_name(path.name + ".partial").exists()


def _raw_file(path, entries: dict, data: bytes = bytes(64)) -> None:
    head = json.dumps(entries).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


@pytest.mark.parametrize(
    "entry,says",
    [
        ({"dtype": "U8", "shape": [4]}, "malformed header entry"),
        ({"dtype": "U8", "shape": [4], "data_offsets": [0]}, "malformed header entry"),
        ({"dtype": "U8", "shape": ["4"], "data_offsets": [0, 4]}, "malformed header entry"),
        ({"dtype": "U8", "shape": [2.0, 2], "data_offsets": [0, 4]}, "malformed header entry"),
        ({"dtype": "U8", "shape": [-4], "data_offsets": [4, 0]}, "malformed header entry"),
        ({"dtype": "U8", "shape": 4, "data_offsets": [0, 4]}, "malformed header entry"),
        ({"dtype": "Q4", "shape": [4], "data_offsets": [0, 4]}, "unknown dtype 'Q4'"),
        ({"dtype": ["U8"], "shape": [4], "data_offsets": [0, 4]}, "unknown dtype"),
        (
            {"dtype": "U16", "shape": [4], "data_offsets": [0, 4]},
            "spans 4 bytes but U16[4] needs 8",
        ),
        ({"dtype": "U8", "shape": [80], "data_offsets": [0, 80]}, "the file is truncated"),
    ],
)
def test_a_bad_header_entry_names_the_file_and_the_tensor(tmp_path, entry, says):
    path = tmp_path / "x.safetensors"
    _raw_file(path, {"ok": {"dtype": "U8", "shape": [2, 2], "data_offsets": [0, 4]}, "t": entry})
    with pytest.raises(CheckpointError, match=f"{path}: tensor 't'") as e:
        read_header(path)
    assert says in str(e.value)


@pytest.mark.parametrize("preadv", [True, False])
def test_read_parts_stacks_byte_ranges_from_files_and_names_a_short_one(
    tmp_path, monkeypatch, preadv
):
    if not preadv:  # a Python without os.preadv: one pread a piece
        monkeypatch.delattr(os, "preadv")
    rng = np.random.default_rng(0)
    blobs = [rng.integers(0, 256, 4096, dtype=np.uint8).tobytes() for _ in range(2)]
    paths = [tmp_path / "a.bin", tmp_path / "b.bin"]
    for p, b in zip(paths, blobs, strict=True):
        p.write_bytes(b)
    # parts out of file order, from two files, of 12 bytes each: three uint32 apiece
    where = [(1, 400), (0, 4000), (0, 8), (1, 0)]
    parts = [
        TensorInfo(f"e{i}", "U8", (12,), at, at + 12, paths[f]) for i, (f, at) in enumerate(where)
    ]
    got = read_parts(parts, "U32", (4, 3))
    want = np.frombuffer(b"".join(blobs[f][at : at + 12] for f, at in where), np.uint32)
    np.testing.assert_array_equal(np.array(got), want.reshape(4, 3))
    short = TensorInfo("e9", "U8", (12,), 4090, 4102, paths[0])
    with pytest.raises(CheckpointError, match=f"{paths[0]}: short read of tensor 'e9'"):
        read_parts([parts[0], short], "U8", (2, 12))
    with pytest.raises(ValueError, match="2 parts of 24 bytes are not U8"):
        read_parts(parts[:2], "U8", (4, 12))
    # 4,096 one-byte parts back to back, in reverse: runs of adjacent parts, more of
    # them than one preadv takes
    rev = [TensorInfo(f"b{i}", "U8", (1,), i, i + 1, paths[1]) for i in reversed(range(4096))]
    np.testing.assert_array_equal(
        np.array(read_parts(rev, "U8", (4096,))), np.frombuffer(blobs[1], np.uint8)[::-1]
    )


def test_open_files_read_like_read_bytes_with_at_most_most_open(tmp_path):
    rng = np.random.default_rng(1)
    paths = [tmp_path / f"{i}.bin" for i in range(3)]
    blobs = [rng.integers(0, 256, 1000, dtype=np.uint8).tobytes() for _ in paths]
    for p, b in zip(paths, blobs, strict=True):
        p.write_bytes(b)
    files = OpenFiles(most=2)
    fd_dir = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    before = len(os.listdir(fd_dir))
    # files in turn, ranges within tensors: each read as read_bytes reads it
    for f, at, start, length in [(0, 10, 5, 20), (1, 0, 0, None), (2, 900, 50, 50), (0, 10, 0, 1)]:
        t = TensorInfo("t", "U8", (100,), at, at + 100, paths[f])
        assert files.read(t, start, length) == read_bytes(t, start, length)
        assert len(os.listdir(fd_dir)) - before <= 2
    short = TensorInfo("e9", "U8", (12,), 990, 1002, paths[1])
    with pytest.raises(CheckpointError, match=f"{paths[1]}: short read of tensor 'e9'"):
        files.read(short)
    files.close()
    assert len(os.listdir(fd_dir)) == before
