"""benchmarks/README.md, generated from every results file: one table per benchmark, newest
first, each row a run (its date, its files, its command, its headline figures).

    .venv/bin/python benchmarks/index.py           # write benchmarks/README.md
    .venv/bin/python benchmarks/index.py --check   # exit 1 when README.md is not what it writes

A results file is ``results/<YYYY-MM-DD>/<name>[-<suffix>].<ext>``; the benchmark it belongs
to is the declared ``Benchmark`` whose name is the longest prefix of ``<name>[-<suffix>]``
(``fuzz-g`` is ``fuzz``'s). What a benchmark shows is declared once, in ``headlines.py`` (its
script, one line on what it measures, its headline figures as paths into the JSON); a file no
benchmark claims gets a section of its own with its command and no figures. Commands are
shown with today's script and results paths (``moved.tsv``: the scripts' old paths); the
JSON keeps the command as it was run.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # headlines.py, beside this script
from headlines import ALL, BENCHMARKS, SUBJECTS, Benchmark, Figure, Pick, Step  # noqa: E402

RESULTS = HERE / "results"
README = HERE / "README.md"
MOVED = HERE / "moved.tsv"
FILE = re.compile(r"(?P<date>\d{4}-\d{2}-\d{2})/(?P<stem>[A-Za-z0-9._-]+?)\.(?P<ext>[A-Za-z0-9]+)")
OLD_RESULT = re.compile(
    r"benchmarks/results/([A-Za-z0-9._-]+?)-([0-9]{4}-[0-9]{2}-[0-9]{2})(-[A-Za-z0-9._-]+)?"
    r"\.([A-Za-z0-9]+)"
)
MAX_COMMAND = 400  # characters of a command shown in a table cell; the JSON has all of it


# -- the files ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    date: str
    stem: str
    files: tuple[str, ...]  # paths relative to benchmarks/, the JSON first


def runs(root: Path = RESULTS) -> list[Run]:
    """Every results stem under ``root`` (``<date>/<stem>.<ext>``), its files together."""
    found: dict[tuple[str, str], list[str]] = {}
    for p in sorted(root.glob("*/*")):
        rel = p.relative_to(root).as_posix()
        m = FILE.fullmatch(rel)
        if not m:
            raise SystemExit(
                f"benchmarks/results/{rel}: not <YYYY-MM-DD>/<name>.<ext>; move it into its "
                "date's folder"
            )
        found.setdefault((m["date"], m["stem"]), []).append(p.relative_to(HERE).as_posix())
    out = []
    for (date, stem), files in found.items():
        files.sort(key=lambda f: (not f.endswith(".json"), f))
        out.append(Run(date, stem, tuple(files)))
    return out


def owner(stem: str) -> Benchmark | None:
    """The declared benchmark whose name is the longest prefix of ``stem``."""
    best = None
    for b in BENCHMARKS:
        if stem == b.name or stem.startswith(b.name + "-"):
            if best is None or len(b.name) > len(best.name):
                best = b
    return best


# -- values ------------------------------------------------------------------------------


def resolve(data, path: tuple[Step, ...]) -> list:
    """The values at ``path`` (several where it holds ``ALL``; none where it is missing)."""
    vals = [data]
    for step in path:
        nxt = []
        for v in vals:
            if step == ALL:
                nxt += list(v.values()) if isinstance(v, dict) else list(v or [])
            elif isinstance(step, Pick):
                if isinstance(v, list):
                    nxt += [x for x in v if isinstance(x, dict) and x.get(step.key) == step.value]
            elif isinstance(v, dict) and step in v:
                nxt.append(v[step])
            elif isinstance(v, list) and isinstance(step, int) and -len(v) <= step < len(v):
                nxt.append(v[step])
        vals = nxt
    return vals


def figure(data, f: Figure) -> str:
    vals = [v for v in resolve(data, f.path) if v is not None]
    if f.agg == "count":
        return str(len(vals))
    if not vals:
        return "–"
    if f.agg:
        nums = [v for v in vals if isinstance(v, int | float) and not isinstance(v, bool)]
        if not nums:
            return "–"
        v = {"max": max, "min": min, "sum": sum}[f.agg](nums)
    else:
        v = vals[0]
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v) if not isinstance(v, dict | list) else "…"
    return f.fmt.format(v / f.scale if f.scale != 1.0 else v)


def moved() -> list[tuple[str, str]]:
    """(old, new) script paths under benchmarks/, from moved.tsv."""
    rows = []
    for line in MOVED.read_text().splitlines():
        if line and not line.startswith("#"):
            old, new = line.split("\t")
            rows.append((old, new))
    return rows


def today(cmd: str, renames: list[tuple[str, str]]) -> str:
    """A recorded command with today's script and results paths."""
    cmd = OLD_RESULT.sub(r"benchmarks/results/\2/\1\3.\4", cmd)
    for old, new in renames:
        cmd = re.sub(rf"benchmarks/{re.escape(old)}(?![\w/])", f"benchmarks/{new}", cmd)
    return cmd


def command(data, b: Benchmark | None, renames: list[tuple[str, str]]) -> str:
    vals = [v for p in (b.command if b else (("command",),)) for v in resolve(data, p)]
    if not vals:
        return ""
    c = vals[0]
    if isinstance(c, list):
        argv = all(isinstance(x, str) and " " not in x for x in c)
        c = shlex.join(c) if argv else " ; ".join(str(x) for x in c)
    c = today(str(c), renames)
    return c if len(c) <= MAX_COMMAND else c[: MAX_COMMAND - 1] + "…"


# -- the page ----------------------------------------------------------------------------


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def code(text: str) -> str:
    if not text:
        return "(not recorded)"
    ticks = "``" if "`" in text else "`"
    pad = " " if "`" in text else ""
    return f"{ticks}{pad}{cell(text)}{pad}{ticks}"


def links(files: tuple[str, ...]) -> str:
    out = []
    for i, f in enumerate(files):
        name = f.rsplit("/", 1)[1]
        out.append(f"[{name if i == 0 else name.rsplit('.', 1)[1]}]({f})")
    return ", ".join(out)


def section(title: str, b: Benchmark | None, rows: list[Run], renames) -> list[str]:
    figs = b.figures if b else ()
    lines = [f"### {title}", ""]
    if b:
        tag = " **Projection** (a model; its constants and their sources are in the JSON)."
        lines += [f"`{b.script}`: {b.what}." + (tag if b.projection else ""), ""]
    head = ["date", "files", "command", *(f.label for f in figs)]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: (r.date, r.stem), reverse=True):
        data = {}
        if r.files[0].endswith(".json"):
            data = json.loads((HERE / r.files[0]).read_text())
        cmd = command(data, b, renames) if isinstance(data, dict) else ""
        vals = [cell(figure(data, f)) if data else "–" for f in figs]
        lines.append("| " + " | ".join([r.date, links(r.files), code(cmd), *vals]) + " |")
    return [*lines, ""]


INTRO = """\
# Benchmarks

Generated by `benchmarks/index.py` from every file in `results/`: do not edit; run
`.venv/bin/python benchmarks/index.py` after adding results (`tests/bench/test_index.py` fails
when this page is not what it writes).

- **Here**: runnable scripts by subject (`speed/`, `quality/`, `memory/`, `pipeline/`,
  `serving/`, `agents/`, `faults/`; `_served.py` starts the 2-rank server for the serving ones).
  The library they run is `k3dist/bench/` (reports, evaluators, the cost model, comparisons).
- **Results**: `results/<YYYY-MM-DD>/<name>[-<suffix>].json`, each holding the exact command
  that made it (plus versions, machine and load average where the script records them); a
  `.md` or `.png` beside it is its table or plot.
- **Rerun** a row: its command, from the checkout, with `.venv/bin/python` (the scripts under
  `mlx.launch` say so in their docstring); write to `results/<today>/<name>.json`. Timings here
  come from a 2-core Linux box shared with other jobs (`mlx[cpu]`, OpenBLAS, float32
  activations, ranks on loopback): compare ratios taken side by side in one run, not absolute
  times across rows.
- **Projections** (marked below: the cost model's decode and prefill speeds on M3 Ultras, the
  real K3's plans and disk plans, the rehearsal's per-stage times, memory bounds) are a model's
  numbers, not measurements: each JSON carries its constants and where each comes from; the
  speed model and its constants are explained in `docs/speed.md`.
"""


def render(root: Path = RESULTS) -> str:
    renames = moved()
    by: dict[str, list[Run]] = {}
    for r in runs(root):
        b = owner(r.stem)
        by.setdefault(b.name if b else r.stem, []).append(r)
    declared = {b.name: b for b in BENCHMARKS}
    out = [INTRO]
    for subject, heading in SUBJECTS.items():
        names = [n for n in by if (declared[n].subject if n in declared else "other") == subject]
        if not names:
            continue
        out += [f"## {heading}", ""]
        for n in sorted(names):
            b = declared.get(n)
            title = f"{n} ({b.script})" if b else n
            out += section(title, b, by[n], renames)
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when README.md differs")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if README.read_text() != text:
            print(
                "benchmarks/README.md is not what benchmarks/index.py writes: run "
                "`.venv/bin/python benchmarks/index.py` and commit the page",
                file=sys.stderr,
            )
            return 1
        return 0
    README.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
