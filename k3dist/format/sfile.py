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
import queue
import struct
import threading
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


class _Digests(threading.Thread):
    """SHA-256 digests on their own thread: ``feed`` queues a batch of tensor-data items
    (bytes, or ``_END`` + a name closing that tensor), the thread hashes them in order
    (hashlib releases the GIL over buffers of 2 KiB and more, so it runs beside the
    writer and the other digest). ``tensors``: one digest per tensor, each ended by its
    marker; else the running digest of everything fed, seeded with ``seed``."""

    def __init__(self, tensors: bool, seed: bytes = b""):
        super().__init__(daemon=True)
        self.per_tensor = tensors
        self._q: queue.Queue = queue.Queue(maxsize=1)  # the batch being hashed + one
        self._h = hashlib.sha256(seed)
        self.digests: dict[str, str] = {}
        self.error: BaseException | None = None
        self.start()

    def feed(self, batch: list | None) -> None:
        self._q.put(batch)

    def run(self) -> None:
        h = self._h
        try:
            while (batch := self._q.get()) is not None:
                for item in batch:
                    if type(item) is tuple:  # (_END, name)
                        if self.per_tensor:
                            self.digests[item[1]] = h.hexdigest()
                            h = hashlib.sha256()
                    else:
                        h.update(item)
        except BaseException as e:  # re-raised by the writer's close
            self.error = e
            while self._q.get() is not None:  # drain: the writer never blocks on a dead thread
                pass
        self._h = h

    def finish(self):  # -> the digest object
        self.feed(None)
        self.join()
        if self.error is not None:
            raise self.error
        return self._h


_END = "end"
_BATCH_BYTES = 1 << 20  # small chunks go to the digest threads in batches of ~1 MiB


class StreamWriter:
    """Write a safetensors file whose tensor list is known before the data is.

    ``write(name, data)`` must follow the declared order; ``data`` is bytes or an
    iterable of byte chunks (so a stacked tensor can be copied expert by expert).
    The file appears under its final name only after ``close()`` checks that every
    byte arrived; ``sha256`` is the digest of the final file, ``header_sha256`` that of
    its header bytes and ``tensor_sha256`` each tensor's (so a damaged file's tensor
    can be named: ``k3dist.format.verify``). The file digest and the tensor digests are
    computed on two threads of their own (:class:`_Digests`) while this one writes;
    ``digests=False`` computes none (scratch that is deleted unread by anything that
    checks it: ``sha256`` and ``tensor_sha256`` stay empty).
    """

    def __init__(
        self,
        path: str | Path,
        entries: list[tuple[str, str, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
        digests: bool = True,
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
        head = struct.pack("<Q", len(raw)) + raw
        self._f = open(self.partial, "wb")
        self._f.write(head)
        self.header_sha256 = hashlib.sha256(head).hexdigest()
        self._threads = (_Digests(False, head), _Digests(True)) if digests else ()
        self._batch: list = []
        self._batched = 0
        self.tensor_sha256: dict[str, str] = {}
        self._next = 0
        self.size = 8 + len(raw) + offset
        self.sha256: str | None = None

    def _flush(self) -> None:
        if self._batch:
            for t in self._threads:
                t.feed(self._batch)
            self._batch, self._batched = [], 0

    def write(self, name: str, data: bytes | Iterable[bytes]) -> None:
        if self._next >= len(self._order) or self._order[self._next][0] != name:
            want = self._order[self._next][0] if self._next < len(self._order) else None
            raise RuntimeError(f"{self.path}: wrote {name!r}, expected {want!r} next")
        expected = self._order[self._next][1]
        got = 0
        hashed = bool(self._threads)
        for chunk in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
            got += len(chunk)
            self._f.write(chunk)
            if hashed:
                if type(chunk) is not bytes:  # the threads hash it later: freeze it
                    chunk = bytes(chunk)
                self._batch.append(chunk)
                self._batched += len(chunk)
                if self._batched >= _BATCH_BYTES:
                    self._flush()
        if got != expected:
            raise RuntimeError(
                f"{self.path}: tensor {name!r} got {got} bytes, header promised {expected}"
            )
        if hashed:
            self._batch.append((_END, name))
        self._next += 1

    def _digests(self) -> None:
        self._flush()
        file_t, tensor_t = self._threads
        self.sha256 = file_t.finish().hexdigest()
        tensor_t.finish()
        self.tensor_sha256 = tensor_t.digests

    def close(self) -> str | None:
        if self._next != len(self._order):
            missing = [n for n, _ in self._order[self._next :]]
            raise RuntimeError(f"{self.path}: closed before writing {missing[:3]}...")
        if self._threads:
            self._digests()
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.partial, self.path)
        return self.sha256

    def abort(self) -> None:
        for t in self._threads:
            t.feed(None)
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
