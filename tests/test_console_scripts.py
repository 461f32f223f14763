"""The console scripts of pyproject.toml: every target exists and answers ``--help``
(in-process: one interpreter, the imports paid once), and every library module that
``python -m`` runs has a script (a new tool without one fails here)."""

from __future__ import annotations

import importlib
import re
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def _runnable_modules() -> set[str]:
    """Modules of k3dist that run as ``python -m``: a ``main`` behind ``__main__``."""
    out = set()
    for p in (REPO / "k3dist").rglob("*.py"):
        text = p.read_text()
        if re.search(r"^def main\(", text, re.M) and "__main__" in text:
            out.add(".".join(p.relative_to(REPO).with_suffix("").parts))
    return out


def test_every_runnable_module_has_a_script():
    targets = {t.split(":")[0] for t in SCRIPTS.values()}
    assert _runnable_modules() - targets == set(), "add these to [project.scripts]"
    assert targets - _runnable_modules() == set(), "these targets run no main()"
    assert all(name.startswith("k3dist-") for name in SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_answers_help(name, monkeypatch, capsys):
    module, func = SCRIPTS[name].split(":")
    main = getattr(importlib.import_module(module), func)
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")
