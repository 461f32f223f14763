"""README.md's and docs/*.md's fenced blocks, their markers and the two-Mac checklist, as
the tests read them (tests/test_docs.py checks every block; tests/two_macs.py and
tests/serve/test_agent_clients.py run the blocks whose marker names them).

A marker is the line before a block (or before the checklist table):
``<!-- run: as written -->``, ``<!-- run: flags -->``, ``<!-- not run: REASON -->`` or
``<!-- tested by: tests/FILE.py::TEST -->``, optionally followed by ``; `` and what that
test substitutes when it runs the block (host, key, paths).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
COMMAND_LANGS = {"sh", "console", "bash", "shell"}
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
MARK = re.compile(r"^<!--\s*(not run|run|tested by):\s*(.*?)\s*-->$")
TESTED_BY = re.compile(r"^(tests/\S+\.py)::(\w+)(?:;\s*(.*))?$", re.S)
GUIDE_HEADING = "## Kimi K3 on two Macs"


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    body: str
    mark: str | None  # "not run" | "run" | "tested by"
    arg: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def marker_before(text: str, start: int) -> tuple[str | None, str]:
    """The marker on the line before offset ``start``: (kind, argument)."""
    before = text[:start].rstrip("\n").rsplit("\n", 1)[-1].strip()
    mark = MARK.match(before)
    return (mark.group(1), mark.group(2)) if mark else (None, "")


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        mark, arg = marker_before(text, m.start())
        line = text[: m.start()].count("\n") + 1
        out.append(Block(path, line, m.group(1).strip(), m.group(2), mark, arg))
    return out


def marker_test(arg: str) -> tuple[str, str, str]:
    """A ``tested by`` marker's (test file, test name, what it substitutes)."""
    m = TESTED_BY.match(arg)
    assert m, f"tested by: {arg!r} is not tests/FILE.py::TEST[; what it substitutes]"
    return m.group(1), m.group(2), m.group(3) or ""


def blocks_run_by(path: Path, test: str) -> list[Block]:
    """The blocks of ``path`` whose ``tested by`` marker names ``test`` (FILE::NAME)."""
    found = [b for b in blocks(path) if b.mark == "tested by"]
    return [b for b in found if "::".join(marker_test(b.arg)[:2]) == test]


def guide_section() -> str:
    return README.read_text().split(GUIDE_HEADING, 1)[1].split("\n## ", 1)[0]


def guide_marker() -> tuple[str | None, str]:
    """The marker on the line before the checklist table."""
    section = guide_section()
    return marker_before(section, section.index("\n| # |") + 1)


def guide_table() -> list[list[str]]:
    """The README's two-Mac checklist: its table rows (cells, `\\|` unescaped)."""
    rows = []
    for line in guide_section().splitlines():
        if line.startswith("| ") and not line.startswith("| #") and "---" not in line:
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows.append(cells)
    return rows


def row_commands(row: list[str]) -> list[str]:
    """The commands of one checklist row: the code spans with a space in its "do this"."""
    return [c for c in re.findall(r"`([^`]*)`", row[2]) if " " in c]


def guide_commands() -> list[str]:
    """Every command in the checklist's "do this" column."""
    return [c for row in guide_table() for c in row_commands(row)]


def simple_commands(text: str) -> list[list[str]]:
    """The simple commands of a shell text (continuations joined, comments dropped,
    split at && || | ; and redirections), leading VAR=value words and sudo dropped."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        lex.commenters = "#"
        cur, redirect = [], False
        for tok in lex:
            if tok in (">", ">>", "<", "2>"):
                redirect = True  # its target is a file, not a command
            elif tok and set(tok) <= set("&|;()"):
                out.append(cur)
                cur = []
            elif redirect:
                redirect = False
            else:
                cur.append(tok)
        out.append(cur)
    cmds = []
    for c in out:
        while c and (re.match(r"^[A-Z_][A-Z0-9_]*=", c[0]) or c[0] in ("sudo", "export")):
            c = c[1:]
        if c:
            cmds.append(c)
    return cmds
