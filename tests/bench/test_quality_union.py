"""benchmarks/quality/quality_union.py: the union of quality reports on one teacher and one set of
windows, rows that reproduce kept once, rows that do not listed (or refused), reports on
other windows refused; run as the script, on a committed report."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "quality" / "quality_union.py"
BASE = REPO / "benchmarks" / "results" / "2026-12-02" / "quality-bits-b.json"


def _run(tmp_path: Path, reports: list[dict], *flags: str) -> subprocess.CompletedProcess:
    paths = []
    for i, rep in enumerate(reports):
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps(rep))
        paths.append(str(p))
    return subprocess.run(
        [sys.executable, str(SCRIPT), *paths, "--out", str(tmp_path / "u.json"), *flags],
        capture_output=True,
        text=True,
    )


def _split(tmp_path: Path) -> tuple[dict, dict]:
    """The base report as two runs: the first 7 rows, then 4 of them again plus the rest."""
    base = json.loads(BASE.read_text())
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    a["rows"] = base["rows"][:7]
    b["rows"] = copy.deepcopy(base["rows"][3:])
    b["teacher"]["build"] = "/elsewhere/mxfp4"  # a rebuilt teacher: same numbers
    for r in b["rows"]:
        r["path"] = "/elsewhere/" + r["build"]
    return a, b


def test_union_of_reproducing_reports(tmp_path):
    a, b = _split(tmp_path)
    res = _run(tmp_path, [a, b], "--strict")
    assert res.returncode == 0, res.stderr
    u = json.loads((tmp_path / "u.json").read_text())
    base = json.loads(BASE.read_text())
    assert [r["build"] for r in u["rows"]] == [r["build"] for r in base["rows"]]
    assert u["reproduced"] == [r["build"] for r in base["rows"][3:7]]
    assert u["disagreements"] == []
    both = [str(tmp_path / "r0.json"), str(tmp_path / "r1.json")]
    assert [r["reports"] for r in u["rows"]] == [both[:1]] * 3 + [both] * 4 + [both[1:]] * 3
    ref = next(r["kl"] for r in base["rows"] if r["build"] == "2bit-g64")
    for r in base["rows"]:
        assert abs(u["closes"][r["build"]] - (1 - r["kl"] / ref)) < 1e-4
    assert u["closes"]["2bit-g64"] == 0
    md = (tmp_path / "u.md").read_text()
    assert "closes of 2bit-g64" in md and "| graded-3.0-2bit-g64 |" in md
    assert "1.8e-05" in md  # the drop rate is not rounded to 0
    assert (tmp_path / "u.png").stat().st_size > 0


def test_row_that_does_not_reproduce(tmp_path):
    a, b = _split(tmp_path)
    b["rows"][0]["kl_p95"] += 1e-6  # base row 3: graded-2.5944-2bit-g64
    res = _run(tmp_path, [a, b])
    assert res.returncode == 0, res.stderr
    u = json.loads((tmp_path / "u.json").read_text())
    (d,) = u["disagreements"]
    assert d["build"] == "graded-2.5944-2bit-g64" and list(d) == ["build", "reports", "kl_p95"]
    assert d["kl_p95"][1] == d["kl_p95"][0] + 1e-6
    row = next(r for r in u["rows"] if r["build"] == "graded-2.5944-2bit-g64")
    assert row["kl_p95"] == d["kl_p95"][1] and row["reports"] == [str(tmp_path / "r1.json")]
    res = _run(tmp_path, [a, b], "--strict")
    assert res.returncode != 0 and "row graded-2.5944-2bit-g64" in res.stderr


def test_other_windows_refused(tmp_path):
    a, b = _split(tmp_path)
    b["windows_per_domain"] = 12
    res = _run(tmp_path, [a, b])
    assert res.returncode != 0 and "windows_per_domain" in res.stderr
    a, b = _split(tmp_path)
    b["teacher"]["ppl"]["code"] += 0.01
    res = _run(tmp_path, [a, b])
    assert res.returncode != 0 and "teacher.ppl" in res.stderr
