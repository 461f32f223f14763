"""Safetensors files without a framework in the way: headers, byte ranges, streams.

Reading: the 8-byte header length + JSON header is all an audit needs; a tensor is
a byte range we can read on its own. Writing: the header is computed up front from
(name, dtype, shape), then tensors are streamed in order (whole or in chunks) into
``NAME.partial``, hashed as they go, and renamed into place only when complete, so
an interrupted run never leaves a file that looks finished.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import json
import os
import queue
import struct
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

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


class TensorInfo(NamedTuple):
    """Where one tensor's bytes are. A named tuple, not a dataclass: a K3 source has
    497,220 of them, and a tuple is made ~5x faster."""

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
        # one pass over every entry: at K3's 5,404 a shard the checks are most of a parse
        try:
            dtype, shape, (b, e) = t["dtype"], tuple(t["shape"]), t["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{path}: tensor {name!r} has a malformed header entry {t!r}"
            ) from None
        if type(dtype) is not str or dtype not in DTYPE_BYTES:
            raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        need = DTYPE_BYTES[dtype]
        for d in shape:
            if type(d) is not int:
                need = None
                break
            need *= d
        if need is None or type(b) is not int or type(e) is not int or not 0 <= b <= e:
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {t!r}")
        if e - b != need:
            raise CheckpointError(
                f"{path}: tensor {name!r} spans {e - b} bytes but {dtype}{list(shape)} needs {need}"
            )
        if data_offset + e > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {data_offset + e} but "
                f"the file has {size}; the file is truncated, copy it again"
            )
        tensors[name] = TensorInfo(name, dtype, shape, data_offset + b, data_offset + e, path)
    return Header(path, tensors, metadata, data_offset, size)


def _whole(info: TensorInfo, data: bytes, length: int) -> bytes:
    if len(data) != length:
        raise CheckpointError(
            f"{info.path}: short read of tensor {info.name!r}; the file changed or is truncated"
        )
    return data


def read_bytes(info: TensorInfo, start: int = 0, length: int | None = None) -> bytes:
    """Bytes of one tensor (or a sub-range of them), read directly from disk."""
    length = info.nbytes - start if length is None else length
    with open(info.path, "rb") as f:
        f.seek(info.start + start)
        return _whole(info, f.read(length), length)


class OpenFiles:
    """:func:`read_bytes` for many small reads: the files stay open, one ``pread`` a
    read (the graded stage reads K3's 82,432 experts part by part, ~500,000 reads of
    parts spread over their shard: an open a read cost 18 % of its CPU on the k3counts
    preset, 43.9 -> 36.0 CPU s). At most ``most`` files are open; the least recently
    read closes first. A file replaced while open is still read as opened: for inputs
    that nothing rewrites while they are read (a source, a finished build)."""

    def __init__(self, most: int = 8):
        self.most = most
        self._fds: dict[Path, int] = {}  # in order of last use

    def read(self, info: TensorInfo, start: int = 0, length: int | None = None) -> bytes:
        length = info.nbytes - start if length is None else length
        fd = self._fds.pop(info.path, None)
        if fd is None:
            if len(self._fds) >= self.most:
                os.close(self._fds.pop(next(iter(self._fds))))
            fd = os.open(info.path, os.O_RDONLY)
        self._fds[info.path] = fd
        return _whole(info, os.pread(fd, length, info.start + start), length)

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])

    def __del__(self):
        self.close()


# iovecs one preadv takes (POSIX's IOV_MAX: 1024 on Linux and macOS)
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class _Parts(io.RawIOBase):
    """A one-tensor safetensors stream whose data is ``parts``' bytes back to back
    (``read_parts``). Reading data scatters: the parts a read covers, in file order,
    each run of them adjacent in one file one ``preadv`` into their places in the
    buffer (a K3 layer's 5,376 expert tensors lie back to back in their shard: ~6
    calls, not 5,376)."""

    def __init__(self, parts: Sequence[TensorInfo], dtype: str, shape: tuple[int, ...]):
        self.dst = [0]  # where each part begins in the data
        for t in parts:
            self.dst.append(self.dst[-1] + t.end - t.start)
        total = self.dst[-1]
        if total != nbytes_of(dtype, shape):
            raise ValueError(f"{len(parts)} parts of {total} bytes are not {dtype}{list(shape)}")
        head = json.dumps({"t": {"dtype": dtype, "shape": list(shape), "data_offsets": [0, total]}})
        head += " " * (-len(head) % 8)
        self.pre = struct.pack("<Q", len(head)) + head.encode()
        self.parts = parts
        self.pos = 0
        self.fds: dict[Path, int] = {}
        self.error: CheckpointError | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = (0, self.pos, len(self.pre) + self.dst[-1])[whence] + offset
        return self.pos

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        pre = len(self.pre)
        if self.pos < pre:  # the header: mx.load reads its length, then its JSON
            n = min(len(out), pre - self.pos)
            out[:n] = self.pre[self.pos : self.pos + n]
        else:
            n = min(len(out), pre + self.dst[-1] - self.pos)
            self._scatter(out[:n], self.pos - pre)
        self.pos += n
        return n

    def _scatter(self, out: memoryview, at: int) -> None:
        """Data bytes ``at`` .. ``at + len(out)`` into ``out``."""
        pieces = []  # (file, file offset, length, offset in out)
        k = bisect.bisect_right(self.dst, at) - 1
        while k < len(self.parts) and self.dst[k] < at + len(out):
            t = self.parts[k]
            lo, hi = max(at, self.dst[k]), min(at + len(out), self.dst[k + 1])
            pieces.append((t.path, t.start + lo - self.dst[k], hi - lo, lo - at, t.name))
            k += 1
        pieces.sort()
        run: list = []
        for piece in pieces:
            if run and (
                piece[0] != run[0][0] or piece[1] != run[-1][1] + run[-1][2] or len(run) == IOV_MAX
            ):
                self._read_run(run, out)
                run = []
            run.append(piece)
        if run:
            self._read_run(run, out)

    def _read_run(self, run: list, out: memoryview) -> None:
        path, start = run[0][0], run[0][1]
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        want = sum(p[2] for p in run)
        fd = self.fds[path]
        if hasattr(os, "preadv"):  # macOS has it from 11 on, Linux from 2.6.30
            got = os.preadv(fd, [out[p[3] : p[3] + p[2]] for p in run], start)
        else:  # one pread a piece, copied once more
            got = 0
            for p in run:
                data = os.pread(fd, p[2], p[1])
                out[p[3] : p[3] + len(data)] = data
                got += len(data)
                if len(data) < p[2]:
                    break
        if got != want:
            short = run[bisect.bisect_right([p[1] - start for p in run], got) - 1]
            # kept: mx.load re-raises what a file object raises as a RuntimeError
            self.error = CheckpointError(
                f"{path}: short read of tensor {short[4]!r}; the file changed or is truncated"
            )
            raise self.error

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        super().close()


def read_parts(parts: Sequence[TensorInfo], dtype: str, shape: tuple[int, ...]):
    """``parts``' bytes back to back as one ``mx.array`` of ``dtype`` and ``shape``,
    read now: one ``pread`` a part, straight into the array's memory. (``mx.load`` of a
    file object reads it at once into the array it makes; the lazy alternative, a load
    a part and a concatenate, costs ~8x the CPU at K3's 896 experts a stack and holds
    the parts and the stack together while it runs.)"""
    import mlx.core as mx

    with _Parts(parts, dtype, tuple(shape)) as f:
        try:
            return mx.load(f, format="safetensors")["t"]
        except RuntimeError:
            if f.error is not None:
                raise f.error from None
            raise


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
