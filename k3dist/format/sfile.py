"""Safetensors files without a framework in the way: headers, byte ranges, streams.

Reading: the 8-byte header length + JSON header is all an audit needs; a tensor is
a byte range we can read on its own. Writing: the header is computed up front from
(name, dtype, shape), then tensors are streamed in order (whole or in chunks) into
``NAME.partial``, hashed as they go, and renamed into place only when complete, so
an interrupted run never leaves a file that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}
# numpy has no bfloat16: BF16 travels as its uint16 bit pattern.
NP_DTYPES = {
    "U8": np.uint8,
    "I8": np.int8,
    "U16": np.uint16,
    "I16": np.int16,
    "F16": np.float16,
    "BF16": np.uint16,
    "U32": np.uint32,
    "I32": np.int32,
    "F32": np.float32,
    "U64": np.uint64,
    "I64": np.int64,
    "F64": np.float64,
    "BOOL": np.bool_,
}
# safetensors dtype -> the MLX dtype holding the same bytes (``mx.<name>``)
MLX_NAMES = {
    "BOOL": "bool_",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "F32": "float32",
    "U64": "uint64",
    "I64": "int64",
}
# what a model may compute in (a deployment's ``dtype``), by MLX name
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
MAX_HEADER = 100 * 1024 * 1024  # the safetensors spec's own limit
CHUNK_BYTES = 64 * 1024 * 1024  # the most a streamed copy holds in memory at once


class CheckpointError(ValueError):
    """Bad input: the message names the file, the tensor and the fix."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    end: int  # absolute, exclusive
    path: Path

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_offset: int
    file_size: int


def nbytes_of(dtype: str, shape: Iterable[int]) -> int:
    n = DTYPE_BYTES[dtype]
    for d in shape:
        n *= int(d)
    return n


def read_header(path: str | Path) -> Header:
    """Parse and validate a header; reads only the header bytes."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: shard file is missing (the index names it)")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(
                f"{path}: {size} bytes, too short for a safetensors "
                "header; the file is truncated, copy it again"
            )
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(
                f"{path}: header length {n} exceeds the file size {size}; "
                "the file is truncated or not safetensors"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e})") from None
    metadata = header.pop("__metadata__", None) or {}
    data_offset = 8 + n
    tensors = {}
    for name, t in header.items():
        try:
            dtype, shape = t["dtype"], tuple(int(d) for d in t["shape"])
            b, e = (int(x) for x in t["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{path}: tensor {name!r} has a malformed header entry {t!r}"
            ) from None
        if dtype not in DTYPE_BYTES:
            raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        if e - b != nbytes_of(dtype, shape):
            raise CheckpointError(
                f"{path}: tensor {name!r} spans {e - b} bytes but "
                f"{dtype}{list(shape)} needs {nbytes_of(dtype, shape)}"
            )
        if data_offset + e > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {data_offset + e} but "
                f"the file has {size}; the file is truncated, copy it again"
            )
        tensors[name] = TensorInfo(name, dtype, shape, data_offset + b, data_offset + e, path)
    return Header(path, tensors, metadata, data_offset, size)


def read_bytes(info: TensorInfo, start: int = 0, length: int | None = None) -> bytes:
    """Bytes of one tensor (or a sub-range of them), read directly from disk."""
    length = info.nbytes - start if length is None else length
    with open(info.path, "rb") as f:
        f.seek(info.start + start)
        data = f.read(length)
    if len(data) != length:
        raise CheckpointError(
            f"{info.path}: short read of tensor {info.name!r}; the file changed or is truncated"
        )
    return data


def read_numpy(info: TensorInfo) -> np.ndarray:
    """A tensor as numpy (BF16 as its uint16 bit pattern)."""
    arr = np.frombuffer(read_bytes(info), dtype=NP_DTYPES[info.dtype])
    return arr.reshape(info.shape)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bit patterns (uint16)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def itemsize(dtype: str) -> int:
    """Bytes per value of a safetensors dtype (``BF16``) or an MLX one (``bfloat16``)."""
    return DTYPE_BYTES[{m: st for st, m in MLX_NAMES.items()}.get(dtype, dtype)]


def mx_dtype(dtype: str):
    """The ``mx.Dtype`` of a safetensors dtype (``BF16``) or an MLX name (``bfloat16``)."""
    import mlx.core as mx

    return getattr(mx, MLX_NAMES.get(dtype, dtype))


def mx_dtype_name(a) -> str:
    """safetensors dtype string of an mx.array."""
    import mlx.core as mx

    return {getattr(mx, m): st for st, m in MLX_NAMES.items()}[a.dtype]


def mx_to_bytes(a) -> bytes:
    """Raw little-endian bytes of an mx.array (bfloat16 via its bit pattern)."""
    import mlx.core as mx

    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.asarray(a).tobytes()


class StreamWriter:
    """Write a safetensors file whose tensor list is known before the data is.

    ``write(name, data)`` must follow the declared order; ``data`` is bytes or an
    iterable of byte chunks (so a stacked tensor can be copied expert by expert).
    The file appears under its final name only after ``close()`` checks that every
    byte arrived; ``sha256`` is the digest of the final file, ``header_sha256`` that of
    its header bytes and ``tensor_sha256`` each tensor's (so a damaged file's tensor
    can be named: ``k3dist.format.verify``).
    """

    def __init__(
        self,
        path: str | Path,
        entries: list[tuple[str, str, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ):
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + ".partial")
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        self._order: list[tuple[str, int]] = []
        offset = 0
        for name, dtype, shape in entries:
            n = nbytes_of(dtype, shape)
            header[name] = {
                "dtype": dtype,
                "shape": list(shape),
                "data_offsets": [offset, offset + n],
            }
            self._order.append((name, n))
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep tensor data 8-byte aligned
        self._hash = hashlib.sha256()
        self._f = open(self.partial, "wb")
        self._emit(struct.pack("<Q", len(raw)) + raw)
        self.header_sha256 = hashlib.sha256(struct.pack("<Q", len(raw)) + raw).hexdigest()
        self.tensor_sha256: dict[str, str] = {}
        self._next = 0
        self.size = 8 + len(raw) + offset
        self.sha256: str | None = None

    def _emit(self, b: bytes) -> None:
        self._f.write(b)
        self._hash.update(b)

    def write(self, name: str, data: bytes | Iterable[bytes]) -> None:
        if self._next >= len(self._order) or self._order[self._next][0] != name:
            want = self._order[self._next][0] if self._next < len(self._order) else None
            raise RuntimeError(f"{self.path}: wrote {name!r}, expected {want!r} next")
        expected = self._order[self._next][1]
        got, h = 0, hashlib.sha256()
        for chunk in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
            got += len(chunk)
            self._emit(chunk)
            h.update(chunk)
        if got != expected:
            raise RuntimeError(
                f"{self.path}: tensor {name!r} got {got} bytes, header promised {expected}"
            )
        self.tensor_sha256[name] = h.hexdigest()
        self._next += 1

    def close(self) -> str:
        if self._next != len(self._order):
            missing = [n for n, _ in self._order[self._next :]]
            raise RuntimeError(f"{self.path}: closed before writing {missing[:3]}...")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.partial, self.path)
        self.sha256 = self._hash.hexdigest()
        return self.sha256

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self.partial.unlink(missing_ok=True)

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def iter_chunks(info: TensorInfo, chunk: int = CHUNK_BYTES) -> Iterator[bytes]:
    for start in range(0, info.nbytes, chunk):
        yield read_bytes(info, start, min(chunk, info.nbytes - start))
