"""StreamWriter's digests, computed on threads of their own, against hashlib over the
bytes on disk: the file's, the header's, each tensor's."""

import hashlib

from k3dist.format.sfile import StreamWriter, read_bytes, read_header, sha256_file

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
