"""docs/architecture.md against the tree: every folder listed exists and every folder is
listed; a package's job is the first line of its __init__ docstring, its imports the
ones tests/test_layout.py allows."""

from __future__ import annotations

import ast
import re
import subprocess

from test_layout import MAY_IMPORT
from util import REPO

PAGE = REPO / "docs" / "architecture.md"


def _rows() -> dict[str, list[str]]:
    rows = {}
    for line in PAGE.read_text().splitlines():
        m = re.match(r"\| `([^`]+/)` \|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in m.group(2).split("|")]
    return rows


def test_every_folder_is_listed_and_every_listed_folder_exists():
    rows = _rows()
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    top = {p.split("/")[0] + "/" for p in tracked if "/" in p and not p.startswith(".")}
    packages = {f"k3dist/{p.parent.name}/" for p in (REPO / "k3dist").glob("*/__init__.py")}
    wanted = (top - {"k3dist/"}) | packages | {"k3dist/data/"}
    assert sorted(wanted - set(rows)) == [], "add these to docs/architecture.md"
    assert sorted(f for f in rows if not (REPO / f).is_dir()) == [], "no such folder"


def test_each_package_says_its_job_and_imports_as_the_page_does():
    rows = _rows()
    for pkg, allowed in MAY_IMPORT.items():
        job, imports = rows[f"k3dist/{pkg}/"][:2]
        doc = ast.get_docstring(ast.parse((REPO / "k3dist" / pkg / "__init__.py").read_text()))
        assert doc and doc.splitlines()[0] == job, (pkg, doc and doc.splitlines()[0], job)
        listed = set() if imports.startswith("(") else {x.strip() for x in imports.split(",")}
        assert listed == allowed, (pkg, listed, allowed)
