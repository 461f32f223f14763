"""The journaled output folder every k3dist writer uses (convert, both slicers, the
default and bench caches): files appear under their final names only when complete,
a journal (``.k3dist-progress.json``) records each finished unit with its sha256, a
re-run skips finished units and redoes the first incomplete one, and the manifest
(``k3dist.json``, see ``k3dist.format.manifest``) is written last.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from k3dist.format.manifest import JOURNAL, MANIFEST
from k3dist.format.sfile import CheckpointError


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


class JournaledFolder:
    """One output folder of ``kind`` ("build" or "rank") for ``identity``; refuses a
    folder that holds anything else. ``source`` names the input route (a journal of
    another route is restarted: same bytes, other unit names)."""

    def __init__(
        self,
        path: Path,
        kind: str,
        identity: dict,
        *,
        source: str | None = None,
        describe: Callable[[dict], str] | None = None,
        hint: str = "",
    ):
        self.path, self.kind, self.identity, self.source = Path(path), kind, identity, source
        self.describe = describe
        self.hint = hint
        self.journal: dict = {}

    def open(self) -> bool:
        """Load the journal to resume from; True when the folder is already complete."""
        out = self.path
        out.mkdir(parents=True, exist_ok=True)
        for name in (MANIFEST, JOURNAL):
            p = out / name
            if not p.exists():
                continue
            old = json.loads(p.read_text())
            if (old.get("kind") or "build") != self.kind:
                raise CheckpointError(
                    f"{out}: holds a k3dist {old.get('kind') or 'build'} "
                    f"({p.name}), not a {self._noun}; choose another --out"
                )
            if old.get("identity") != self.identity:
                prev = old.get("identity", {})
                diff = {k: (prev.get(k), v) for k, v in self.identity.items() if prev.get(k) != v}
                detail = "; ".join(
                    f"{k}: folder has {a!r}, this run {b!r}" for k, (a, b) in diff.items()
                )
                held, writes = f"a different {self.kind}", ""
                if self.describe:
                    held = self.describe(prev)
                    writes = f", this run writes {self.describe(self.identity)}"
                raise CheckpointError(
                    f"{out}: already holds {held} ({p.name} differs in {sorted(diff)}: "
                    f"{detail}){writes}; choose another --out{self.hint} or delete the folder"
                )
            if name == MANIFEST:
                return True
            if old.get("input") != self.source:
                old = {**old, "input": self.source, "done": {}}
            self.journal = old
            return False
        leftovers = [p.name for p in out.iterdir() if not p.name.endswith((".partial", ".tmp"))]
        if leftovers:
            raise CheckpointError(
                f"{out}: not empty and not a k3dist {self._noun} (holds "
                f"{leftovers[:5]}); choose an empty or new --out"
            )
        self.journal = {"kind": self.kind, "identity": self.identity, "done": {}}
        if self.source is not None:
            self.journal["input"] = self.source
        return False

    @property
    def _noun(self) -> str:
        return "rank folder" if self.kind == "rank" else self.kind

    @property
    def done(self) -> dict:
        return self.journal["done"]

    def unit(self, name: str, make: Callable[[], dict]) -> bool:
        """Make unit ``name`` (``make`` returns its journal entry: file, bytes, sha256)
        unless the journal has it complete on disk; True when it was made now."""
        entry = self.done.get(name)
        if entry is not None:
            p = self.path / entry["file"]
            if p.exists() and p.stat().st_size == entry["bytes"]:
                return False
        self.done[name] = make()
        write_json_atomic(self.path / JOURNAL, self.journal)
        return True

    def finish(self, manifest: dict) -> None:
        """The manifest, last; the journal goes."""
        write_json_atomic(self.path / MANIFEST, manifest)
        (self.path / JOURNAL).unlink(missing_ok=True)


@contextmanager
def locked(lock: Path) -> Iterator[None]:
    """An exclusive file lock: ranks sharing a machine write a shared cache one at a time."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def remake_stale(folder: Path, make: Callable[[], Path]) -> Path:
    """``make()`` a cached folder; one that holds another identity (a cache of an older
    k3dist: ours to replace) is deleted and made again."""
    try:
        return make()
    except CheckpointError:
        shutil.rmtree(folder)
        return make()
