"""Is a rank folder still what the slicer wrote? Checked on every rank before it serves.

The manifest (``k3dist.json``) holds each file's sha256 and, for safetensors files, the
sha256 of its header and of every tensor (``StreamWriter`` computes them while writing).
Three modes:

- ``stamp`` (the default): a stamp file beside the manifest (``.k3dist-verified.json``)
  records, for each file, the ``stat`` it had when its content last matched the manifest
  (size, mtime_ns, ctime_ns, inode, device) and the digest it matched. A file whose
  ``stat`` still equals its stamp is trusted; any other file (or one with no stamp) is
  hashed against the manifest. The slicer stamps what it writes, so a restart costs a
  few ``stat`` calls, and a file written in place (new mtime; a ctime no tool can set
  back) or replaced (new inode) is hashed again before serving.
- ``full``: hash every file, whatever its stamp says (bit rot, or on demand).
- ``size``: sizes only, as before stamps existed; opt-in.

Files are hashed by a pool of threads (``hashlib`` releases the GIL), each reading one
run of whole tensors at a time through a fixed 8 MiB buffer, so memory stays bounded.
A mismatch names the file and the tensor whose bytes differ, and the fix.

    python -m k3dist.format.verify runs/ranks/rank1 [--mode full] [--threads N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from k3dist.format.manifest import MANIFEST
from k3dist.format.sfile import CheckpointError, read_header

MODES = ("stamp", "full", "size")

STAMP = ".k3dist-verified.json"
STAMP_VERSION = 1
# rank-folder format_version from which the manifest holds per-tensor digests
TENSOR_DIGESTS_SINCE = 2
_BUF = 8 * 1024 * 1024  # read buffer per thread
_UNIT = 256 * 1024 * 1024  # a thread's unit of work: whole tensors, about this many bytes


class VerifyError(CheckpointError):
    """A rank folder whose content no longer matches its manifest."""


@dataclass
class Report:
    mode: str
    files: int
    hashed: list[str] = field(default_factory=list)  # files hashed this time
    bytes_hashed: int = 0
    seconds: float = 0.0
    threads: int = 0
    stamp: str = ""  # "written", "unchanged", or why it could not be written

    def to_json(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        trusted = self.files - len(self.hashed) if self.mode == "stamp" else 0
        return (
            f"verify {self.mode}: {len(self.hashed)} of {self.files} files hashed "
            f"({self.bytes_hashed / 1e6:.1f} MB in {self.seconds:.2f}s, {self.threads} "
            f"threads), {trusted} trusted by stamp; stamp {self.stamp}"
        )


def default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def file_stat(path: Path) -> dict:
    """What a stamp records of a file; any write in place changes mtime and ctime."""
    st = path.stat()
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "ino": st.st_ino,
        "dev": st.st_dev,
    }


def hash_range(path: Path, start: int, length: int, buf: bytearray | None = None) -> str:
    """sha256 of ``length`` bytes of ``path`` from ``start``, read through ``buf``."""
    buf = buf if buf is not None else bytearray(_BUF)
    view = memoryview(buf)
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        left = length
        while left:
            n = f.readinto(view[: min(left, len(buf))])
            if not n:
                raise VerifyError(
                    f"{path}: ended {left} bytes early while hashing; the "
                    "file changed or is truncated"
                )
            h.update(view[:n])
            left -= n
    return h.hexdigest()


# ----------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class _Range:
    what: str  # "file", "header" or a tensor name
    start: int
    length: int
    digest: str  # expected


def _ranges(folder: Path, name: str, meta: dict) -> tuple[list[_Range], list[str]]:
    """What to hash in one file: its header and each tensor where the manifest has their
    digests, else the whole file. Returns (ranges, problems found without hashing)."""
    path = folder / name
    tensors = meta.get("tensors")
    if not tensors:
        return [_Range("file", 0, meta["bytes"], meta["sha256"])], []
    try:
        h = read_header(path)
    except CheckpointError as e:
        return [], [f"the safetensors header no longer parses ({e})"]
    out = [_Range("header", 0, h.data_offset, meta["header_sha256"])]
    problems = []
    for t in sorted(h.tensors.values(), key=lambda t: t.start):
        want = tensors.get(t.name)
        if want is None:
            problems.append(f"tensor {t.name!r} is not in the manifest")
        else:
            out.append(_Range(t.name, t.start, t.nbytes, want))
    missing = sorted(set(tensors) - set(h.tensors))
    if missing:
        problems.append(f"tensors {missing[:3]} of the manifest are missing from the header")
    return out, problems


def _units(name: str, ranges: list[_Range]) -> list[tuple[str, list[_Range]]]:
    """Runs of consecutive ranges of about ``_UNIT`` bytes: read sequentially by one
    thread; a tensor is never split (its digest is one sequential hash)."""
    units, cur, size = [], [], 0
    for r in ranges:
        cur.append(r)
        size += r.length
        if size >= _UNIT:
            units.append((name, cur))
            cur, size = [], 0
    if cur:
        units.append((name, cur))
    return units


def _hash_unit(folder: Path, unit: tuple[str, list[_Range]]) -> list[tuple[str, _Range, str]]:
    name, ranges = unit
    buf = bytearray(min(_BUF, max(r.length for r in ranges) or 1))
    return [(name, r, hash_range(folder / name, r.start, r.length, buf)) for r in ranges]


# ----------------------------------------------------------------------------- stamps


def read_stamp(folder: Path) -> dict:
    try:
        s = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return {}
    return s.get("files", {}) if s.get("version") == STAMP_VERSION else {}


def write_stamp(folder: Path, entries: dict[str, dict]) -> str:
    """Atomically replace the stamp; returns "written" or why it could not be (a
    read-only folder still serves: each start then hashes what it cannot trust)."""
    tmp = folder / (STAMP + ".tmp")
    try:
        tmp.write_text(
            json.dumps({"version": STAMP_VERSION, "files": entries}, indent=1, sort_keys=True)
            + "\n"
        )
        os.replace(tmp, folder / STAMP)
    except OSError as e:
        return f"not written ({e.strerror}: {e.filename})"
    return "written"


def stamp_entry(path: Path, digest: str) -> dict:
    return {**file_stat(path), "sha256": digest}


def stamp_folder(folder: str | Path, manifest: dict) -> str:
    """Stamp every file of the manifest as matching: for the slicer, which computed the
    digests while writing these very files."""
    folder = Path(folder)
    return write_stamp(
        folder,
        {
            name: stamp_entry(folder / name, meta["sha256"])
            for name, meta in manifest["files"].items()
        },
    )


# ----------------------------------------------------------------------------- verify


def _reslice(folder: Path, manifest: dict) -> str:
    """The command that made this folder (from its manifest)."""
    cmd = f"python slicing/rank_split.py --rank {manifest.get('rank', 'R')}"
    if "size" in manifest:
        cmd += f" --size {manifest['size']}"
    if "build" in manifest:
        cmd += f" --build {manifest['build']}"
    if manifest.get("placement", {}).get("kind", "contiguous") != "contiguous":
        cmd += " --placement-counts COUNTS"
    return f"{cmd} --out {folder}"


def _fix(folder: Path, manifest: dict) -> str:
    return (
        f"copy the file again from a good copy of this folder, or delete {folder} and "
        f"slice it again: {_reslice(folder, manifest)}"
    )


def _check_format(folder: Path, manifest: dict, mode: str) -> None:
    version = manifest.get("identity", {}).get("format_version", 1)
    if version < TENSOR_DIGESTS_SINCE:
        raise VerifyError(
            f"{folder / MANIFEST}: rank folder format {version} (made by "
            f"{manifest.get('tool', 'an older k3dist')}) has no per-tensor digests, so "
            f"--verify {mode} cannot check it; delete {folder} and slice it again with this "
            f"k3dist ({_reslice(folder, manifest)}), or start with --verify size to check "
            "sizes only"
        )


def verify_folder(
    folder: str | Path, manifest: dict, mode: str = "stamp", threads: int | None = None
) -> Report:
    """Check a rank folder's content against its manifest (sizes are checked already);
    VerifyError naming each damaged file, the tensor(s) in it and the fix."""
    if mode not in MODES:
        raise ValueError(f"verify mode must be one of {MODES}, not {mode!r}")
    folder = Path(folder)
    files: dict[str, dict] = manifest["files"]
    report = Report(mode, len(files), threads=threads or default_threads())
    if mode == "size":
        for name, meta in files.items():
            got = (folder / name).stat().st_size if (folder / name).exists() else "missing"
            if got != meta["bytes"]:
                raise VerifyError(
                    f"{folder / name}: {got} bytes, the manifest says "
                    f"{meta['bytes']}; {_fix(folder, manifest)}"
                )
        report.stamp = "unchanged"
        return report
    _check_format(folder, manifest, mode)
    t0 = time.perf_counter()
    old = read_stamp(folder) if mode == "stamp" else {}
    stamps: dict[str, dict] = {}
    todo: list[str] = []
    seen: dict[str, dict] = {}  # stat before hashing: a write during it is seen next time
    for name, meta in files.items():
        path = folder / name
        if not path.exists():
            raise VerifyError(f"{path}: missing; {_fix(folder, manifest)}")
        seen[name] = stamp_entry(path, meta["sha256"])
        if old.get(name) == seen[name]:
            stamps[name] = seen[name]
        else:
            todo.append(name)
    problems: dict[str, list[str]] = {}
    units = []
    for name in todo:
        ranges, found = _ranges(folder, name, files[name])
        if found:
            problems[name] = found
        units += _units(name, ranges)
    units.sort(key=lambda u: -sum(r.length for r in u[1]))  # longest first: balanced
    with ThreadPoolExecutor(report.threads) as pool:
        results = [x for part in pool.map(lambda u: _hash_unit(folder, u), units) for x in part]
    for name, r, got in results:
        report.bytes_hashed += r.length
        if got != r.digest:
            where = (
                "whole file"
                if r.what == "file"
                else "safetensors header"
                if r.what == "header"
                else f"tensor {r.what!r}"
            )
            problems.setdefault(name, []).append(
                f"{where} (bytes {r.start:,}..{r.start + r.length:,}) sha256 {got[:16]} "
                f"!= manifest {r.digest[:16]}"
            )
    report.hashed = todo
    for name in todo:
        if name not in problems:
            stamps[name] = seen[name]
    report.stamp = write_stamp(folder, stamps) if todo or mode == "full" else "unchanged"
    report.seconds = round(time.perf_counter() - t0, 3)
    if problems:
        lines = "; ".join(
            f"{folder / n}: {', '.join(p[:3])}" + (f" and {len(p) - 3} more" if len(p) > 3 else "")
            for n, p in sorted(problems.items())
        )
        raise VerifyError(
            f"rank {manifest.get('rank')} folder {folder} is damaged and will "
            f"not be served: {lines}; {_fix(folder, manifest)}"
        )
    return report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description="Check a rank folder's content against its manifest (k3dist.json)"
    )
    ap.add_argument("folder")
    ap.add_argument("--mode", choices=MODES, default="full")
    ap.add_argument("--threads", type=int, help=f"hashing threads (default {default_threads()})")
    args = ap.parse_args(argv)
    folder = Path(args.folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        report = verify_folder(folder, manifest, args.mode, args.threads)
    except (CheckpointError, OSError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    print(json.dumps(report.to_json()))
    print(report.summary(), file=sys.stderr)


if __name__ == "__main__":
    main()
