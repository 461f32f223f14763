"""benchmarks/: the README is what benchmarks/index.py writes from the results, results sit
in dated folders, scripts in subject folders under names no k3dist.bench module has, and
every script the index or moved.tsv names exists."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from util import REPO

BENCH = REPO / "benchmarks"


def _index():
    spec = importlib.util.spec_from_file_location("bench_index", BENCH / "index.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_readme_is_what_the_index_writes():
    r = subprocess.run(
        [sys.executable, str(BENCH / "index.py"), "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr


def test_index_check_fails_on_a_stale_page(tmp_path, monkeypatch):
    index = _index()
    page = tmp_path / "README.md"
    page.write_text(index.render() + "a hand-written line\n")
    monkeypatch.setattr(index, "README", page)
    assert index.main(["--check"]) == 1
    assert index.main([]) == 0 and index.main(["--check"]) == 0


def test_results_are_in_dated_folders():
    loose = [p.name for p in (BENCH / "results").iterdir() if p.is_file()]
    assert not loose, f"benchmarks/results/: move into results/<YYYY-MM-DD>/: {loose}"
    index = _index()
    assert index.runs()  # every file matches <YYYY-MM-DD>/<name>.<ext> (else SystemExit)


def test_scripts_are_by_subject_and_named_unlike_the_library():
    library = {p.stem for p in (REPO / "k3dist" / "bench").glob("*.py")}
    library |= {p.name for p in (REPO / "k3dist" / "bench").iterdir() if p.is_dir()}
    flat = [
        p.name
        for p in BENCH.glob("*.py")
        if p.name not in ("index.py", "headlines.py", "_served.py")
    ]
    assert not flat, f"benchmarks/: put these in a subject folder: {flat}"
    scripts = sorted(BENCH.glob("*/*.py"))
    assert scripts
    clash = [str(p.relative_to(BENCH)) for p in scripts if p.stem in library]
    assert not clash, f"named like a k3dist.bench module (rename for what it measures): {clash}"


def test_declared_and_moved_scripts_exist():
    index = _index()
    for old, new in index.moved():
        assert (BENCH / new).is_file(), f"benchmarks/moved.tsv: {old} -> {new}: no such script"
        assert not (BENCH / old).exists(), f"benchmarks/{old}: moved to {new}, still there"
    for b in index.BENCHMARKS:
        assert b.subject in index.SUBJECTS, b.name
        path = b.script.split()[0]
        if path.endswith(".py") and not path.startswith("train/"):
            assert (BENCH / path).is_file(), f"benchmarks/index.py: {b.name}: no {path}"
