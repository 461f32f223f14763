"""Calibration text -> a token set, through the checkpoint's OWN tokenizer.

The streamed teacher, calibration and DWQ read a token set (``.npz``: ``inputs`` and
``targets`` [windows, seq] int32, ``domain`` per window, as ``k3dist.factory.windows``
writes). For the real K3 that means K3's tiktoken vocabulary (163,840 entries): the
tokenizer is loaded from the source folder the way mlx-lm loads it
(``mlx_lm.utils.load_tokenizer``), never from the mini-K3's corpus.

Sources: plain text files (``.txt``, ``.md``, code, ...: one document each) and JSONL
(``.jsonl``: one document a line, its ``text`` field, else ``content``, else the
concatenated ``content`` of ``messages``; optional ``domain`` and ``lang`` fields).
Each source is cut into non-overlapping windows of ``seq + 1`` tokens (documents joined
with the end-of-text token); windows are taken from the sources in turn until
``windows`` are chosen, so no source crowds the others out.

With no text given, :func:`default_sources` is the documented default mix, present on
any machine with the project installed: Python's standard library sources (``code``)
and the docstrings of those modules (``prose``, English). It has no other natural
language and no chat: :func:`warnings_for` names every domain and language whose share
is under ``MIN_SHARE`` (calibration decides which experts are promoted; what the corpus
lacks is degraded silently), and says which of ``EXPECTED_LANGS`` are missing.

    python -m k3dist.pipeline.calibtext --src SRC --out calib.npz [FILES...] [--windows N]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import shutil
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MIN_SHARE = 0.05
EXPECTED_LANGS = ("en", "zh")  # K3 is trained mostly on these; name a missing one
CODE_SUFFIXES = {
    ".py",
    ".c",
    ".h",
    ".cc",
    ".cpp",
    ".rs",
    ".go",
    ".js",
    ".ts",
    ".java",
    ".sh",
    ".swift",
    ".m",
    ".rb",
    ".lua",
    ".sql",
    ".json",
    ".yaml",
    ".toml",
}
# the default mix: deterministic, from the running Python's standard library
DEFAULT_CODE_MODULES = (
    "json",
    "argparse",
    "asyncio",
    "email",
    "http",
    "logging",
    "unittest",
    "collections",
    "pathlib.py",
    "dataclasses.py",
    "functools.py",
    "textwrap.py",
    "shutil.py",
    "subprocess.py",
)


class CalibTextError(ValueError):
    pass


@dataclass
class TextSource:
    name: str  # a path, or "stdlib:code" / "stdlib:docstrings"
    domain: str
    docs: list[str] = field(default_factory=list)
    lang: str | None = None  # None: detected per source from its characters


def language(text: str) -> str:
    """A coarse script-based language: zh (CJK), ja (kana), ko (hangul), ru (Cyrillic),
    en (mostly ASCII letters), other."""
    counts = {"zh": 0, "ja": 0, "ko": 0, "ru": 0, "en": 0}
    for ch in text[:200_000]:
        o = ord(ch)
        if 0x4E00 <= o <= 0x9FFF:
            counts["zh"] += 1
        elif 0x3040 <= o <= 0x30FF:
            counts["ja"] += 1
        elif 0xAC00 <= o <= 0xD7AF:
            counts["ko"] += 1
        elif 0x0400 <= o <= 0x04FF:
            counts["ru"] += 1
        elif ch.isascii() and ch.isalpha():
            counts["en"] += 1
    # CJK characters carry a word each; weight them against letters
    weighted = {k: v * (1 if k in ("en", "ru") else 4) for k, v in counts.items()}
    best = max(weighted, key=weighted.get)
    return best if weighted[best] else "other"


def _jsonl_docs(path: Path) -> Iterator[dict]:
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise CalibTextError(
                f"{path}:{n}: not JSON ({e.msg}); one JSON object a line with a 'text' field"
            ) from None
        if not isinstance(rec, dict):
            raise CalibTextError(f"{path}:{n}: a JSON {type(rec).__name__}, not an object")
        text = rec.get("text") or rec.get("content")
        if text is None and isinstance(rec.get("messages"), list):
            text = "\n".join(
                str(m.get("content", "")) for m in rec["messages"] if isinstance(m, dict)
            )
        if not isinstance(text, str) or not text:
            raise CalibTextError(f"{path}:{n}: no 'text', 'content' or 'messages' string")
        yield {"text": text, "domain": rec.get("domain"), "lang": rec.get("lang")}


def read_sources(paths: list[str | Path]) -> list[TextSource]:
    """Text and JSONL files as sources (a folder: every file in it, sorted). A JSONL file
    whose lines name a ``domain`` gives one source per domain."""
    out: list[TextSource] = []
    for p in map(Path, paths):
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file())
            if not files:
                raise CalibTextError(f"{p}: an empty folder; give text or JSONL files")
        elif p.is_file():
            files = [p]
        else:
            raise CalibTextError(f"--calib-text {p}: no such file or folder")
        for f in files:
            if f.suffix == ".jsonl":
                by: dict[tuple, TextSource] = {}
                for rec in _jsonl_docs(f):
                    key = (rec["domain"] or "prose", rec["lang"])
                    src = by.setdefault(
                        key,
                        TextSource(
                            f"{f}" + (f"#{key[0]}" if rec["domain"] else ""), key[0], lang=key[1]
                        ),
                    )
                    src.docs.append(rec["text"])
                out += by.values()
            else:
                try:
                    text = f.read_text(encoding="utf-8")
                except UnicodeDecodeError:
                    raise CalibTextError(
                        f"{f}: not UTF-8 text; give text or JSONL files "
                        "(binary files are not calibration text)"
                    ) from None
                if text.strip():
                    dom = "code" if f.suffix in CODE_SUFFIXES else "prose"
                    out.append(TextSource(str(f), dom, [text]))
    if not out:
        raise CalibTextError(f"--calib-text {[str(p) for p in paths]}: no text in them")
    return out


def default_sources(max_chars: int = 2_000_000) -> list[TextSource]:
    """The default mix (module doc): stdlib code and stdlib docstrings, each up to
    ``max_chars`` characters, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for m in DEFAULT_CODE_MODULES:
        p = stdlib / m
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p] if p.exists() else []
    files = [f for f in files if "test" not in f.parts]
    if not files:
        raise CalibTextError(
            f"{stdlib}: no Python sources found for the default mix; give --calib-text FILES"
        )
    code = TextSource("stdlib:code", "code", lang="en")
    prose = TextSource("stdlib:docstrings", "prose", lang="en")
    n_code = n_prose = 0
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        if n_code < max_chars:
            code.docs.append(text)
            n_code += len(text)
        if n_prose < max_chars:
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if isinstance(
                    node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
                ):
                    d = ast.get_docstring(node)
                    if d and len(d) > 200:  # paragraphs, not one-line summaries
                        prose.docs.append(d)
                        n_prose += len(d)
    return [code, prose]


def load_tokenizer(src: str | Path):
    """The source folder's own tokenizer, as mlx-lm loads it (``load_tokenizer``). A
    Moonshot folder ships ``tiktoken.model`` with a remote-code tokenizer_config.json:
    its fast-tokenizer files are written from that ``tiktoken.model`` into a temporary
    folder first (``k3dist.format.tokens.write_hf_tokenizer``, what the converter puts in
    every build), so no remote code runs."""
    from k3dist.format import tokens
    from k3dist.format.folder import CONFIG_NAME

    from mlx_lm.utils import load_tokenizer as mlx_load

    src = Path(src)
    try:
        if (src / "tokenizer.json").exists() or not (src / "tiktoken.model").exists():
            return mlx_load(src, {"trust_remote_code": False})
        with tempfile.TemporaryDirectory(prefix="k3dist-tok-") as tmp:
            if (src / CONFIG_NAME).exists():
                shutil.copyfile(src / CONFIG_NAME, Path(tmp) / CONFIG_NAME)
            tokens.write_hf_tokenizer(src, Path(tmp))
            return mlx_load(Path(tmp), {"trust_remote_code": False})
    except Exception as e:  # transformers raises many kinds
        raise CalibTextError(
            f"{src}: its tokenizer did not load with mlx_lm.utils.load_tokenizer ({e}); the "
            "folder needs the checkpoint's tokenizer files (tiktoken.model + "
            "tokenizer_config.json, or tokenizer.json)"
        ) from None


def token_set(sources: list[TextSource], tokenizer, windows: int, seq: int) -> dict:
    """Cut every source into windows of ``seq + 1`` tokens and take them in turn
    (module doc). Returns inputs, targets, domain and the per-source report."""
    if windows < 1 or seq < 2:
        raise CalibTextError(f"--windows {windows} / --seq {seq}: need >= 1 and >= 2")
    eos = tokenizer.eos_token_id
    per: list[list[np.ndarray]] = []
    for s in sources:
        ids: list[int] = []
        need = (windows + 1) * (seq + 1)  # no source gives more than all windows
        for d in s.docs:
            ids += tokenizer.encode(d, add_special_tokens=False)
            if eos is not None:
                ids.append(eos)
            if len(ids) >= need:
                break
        n = len(ids) // (seq + 1)
        arr = np.asarray(ids[: n * (seq + 1)], dtype=np.int64).reshape(n, seq + 1)
        per.append(list(arr))
        if s.lang is None:
            s.lang = language("\n".join(s.docs)[:200_000])
    chosen: list[tuple[int, np.ndarray]] = []
    k = 0
    while len(chosen) < windows and any(k < len(w) for w in per):
        for i, w in enumerate(per):
            if k < len(w) and len(chosen) < windows:
                chosen.append((i, w[k]))
        k += 1
    if not chosen:
        raise CalibTextError(
            f"the calibration text holds fewer than {seq + 1} tokens per "
            "source; give more text or a smaller --seq"
        )
    arr = np.stack([w for _, w in chosen]).astype(np.int32)
    vocab = getattr(tokenizer, "vocab_size", None)
    report = []
    for i, s in enumerate(sources):
        n = sum(1 for j, _ in chosen if j == i)
        report.append(
            {
                "source": s.name,
                "domain": s.domain,
                "lang": s.lang,
                "windows": n,
                "tokens": n * seq,
                "share": round(n / len(chosen), 4),
                "available_windows": len(per[i]),
            }
        )
    return {
        "inputs": arr[:, :-1],
        "targets": arr[:, 1:],
        "domain": np.array([sources[i].domain for i, _ in chosen]),
        "sources": report,
        "vocab_size": vocab,
        "seq": seq,
    }


def shares(report: list[dict], key: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in report:
        out[r[key]] = round(out.get(r[key], 0.0) + r["share"], 4)
    return out


def warnings_for(report: list[dict], min_share: float = MIN_SHARE) -> list[str]:
    """One line per domain or language under ``min_share`` and per expected language
    missing (module doc)."""
    out = []
    for key in ("domain", "lang"):
        for name, sh in sorted(shares(report, key).items()):
            if sh < min_share:
                out.append(
                    f"calibration {key} {name!r} is {100 * sh:.1f}% of the windows "
                    f"(< {100 * min_share:.0f}%): experts it routes to are scored on "
                    "almost nothing; add more of it with --calib-text"
                )
    langs = shares(report, "lang")
    missing = [lang for lang in EXPECTED_LANGS if lang not in langs]
    if missing:
        out.append(
            f"calibration text has no {', '.join(missing)} text: experts that serve "
            "these languages are judged without it and may be demoted; add some with "
            "--calib-text"
        )
    for r in report:
        if r["windows"] == 0:
            out.append(f"{r['source']}: shorter than one window; not used")
    return out


def write(out: str | Path, ts: dict, src: str | Path) -> dict:
    """``out`` (.npz, via .partial) and the record the pipeline manifest keeps."""
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    with open(tmp, "wb") as f:
        np.savez(f, inputs=ts["inputs"], targets=ts["targets"], domain=ts["domain"])
    tmp.replace(out)
    return {
        "tokens": str(out),
        "shape": list(ts["inputs"].shape),
        "sha256": hashlib.sha256(np.ascontiguousarray(ts["inputs"]).tobytes()).hexdigest(),
        "tokenizer": str(src),
        "sources": ts["sources"],
        "shares": {
            "domain": shares(ts["sources"], "domain"),
            "lang": shares(ts["sources"], "lang"),
        },
        "warnings": warnings_for(ts["sources"]),
    }


def make(src: str | Path, out: str | Path, files: list[str] | None, windows: int, seq: int) -> dict:
    sources = read_sources(files) if files else default_sources()
    ts = token_set(sources, load_tokenizer(src), windows, seq)
    return write(out, ts, src)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description="Calibration text -> token set through the source folder's own tokenizer."
    )
    ap.add_argument(
        "files", nargs="*", help="text / JSONL files or folders (none: the default stdlib mix)"
    )
    ap.add_argument("--src", required=True, help="checkpoint folder with tokenizer files")
    ap.add_argument("--out", required=True)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    a = ap.parse_args(argv)
    try:
        rec = make(a.src, a.out, a.files, a.windows, a.seq)
    except CalibTextError as e:
        raise SystemExit(f"error: {e}") from None
    for w in rec["warnings"]:
        print(f"warning: {w}")
    print(json.dumps({k: rec[k] for k in ("tokens", "shape", "shares")}, indent=1))


if __name__ == "__main__":
    main()
