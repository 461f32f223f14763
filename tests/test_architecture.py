"""docs/layout.md's module list against the tree: each package's bullet opens with the
first line of its __init__ docstring (the package's one job), and every folder of the
tree (top-level folders, k3dist's packages and data) is named on the page."""

from __future__ import annotations

import ast
import re
import subprocess

from util import REPO

PAGE = REPO / "docs" / "layout.md"


def _text() -> str:
    return " ".join(PAGE.read_text().split())


def test_each_package_bullet_says_its_job_as_its_init_does():
    text = _text()
    for init in sorted((REPO / "k3dist").glob("*/__init__.py")):
        pkg = init.parent.name
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"k3dist/{pkg}/__init__.py: a docstring saying the package's one job"
        m = re.search(rf"- `k3dist/{pkg}/` — (.*?)(?= - `k3dist/|$)", text)
        assert m, f"docs/layout.md: no bullet for k3dist/{pkg}/"
        assert m.group(1).startswith(doc.splitlines()[0]), (pkg, doc.splitlines()[0])


def test_every_folder_is_named():
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    top = {p.split("/")[0] for p in tracked if "/" in p and not p.startswith(".")}
    folders = {f"{t}/" for t in top - {"k3dist"}} | {
        f"k3dist/{p.parent.name}/" for p in (REPO / "k3dist").glob("*/__init__.py")
    }
    folders |= {f"tests/{p.parent.name}/" for p in (REPO / "tests").glob("*/test_*.py")}
    folders.add("k3dist/data/")
    text = PAGE.read_text()
    missing = sorted(f for f in folders if f"`{f}" not in text)
    assert not missing, f"docs/layout.md: name these folders: {missing}"
