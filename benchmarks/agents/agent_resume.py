"""Claude Code's default mode (or Codex ``exec``), unmodified, against the 2-rank trained
mini with a 64K context, until its turn ends (issue 41): its full request (system prompt
and default tools, ~17K tokens for Claude Code, ~12K for Codex) takes longer to prefill on
a small CPU box than the client may wait, so it may give up and send the same request
again; each retry resumes the prefill its predecessor left in the prompt cache, and each
of Claude Code's max-token recovery turns reuses its system prompt and tools. Only Claude
Code's own output cap is set (``CLAUDE_CODE_MAX_OUTPUT_TOKENS``; Codex sends no cap, so the
server's ``max_tokens`` applies); no time-out or retry count is changed. The shipped mini
never ends a message, so its turns end at the cap and fail; ``--model data/mini-k3-chat``
serves the mini that ends its messages (docs/minis.md), whose turns complete. Reports each
request the server saw (prompt tokens, cached tokens it resumed from, where it stopped or
that it finished), the client's exit and result, the total time and the load average.

    nice -n 10 python benchmarks/agents/agent_resume.py [--client claude|codex] \\
        [--max-context 65536] [--max-output-tokens 32] [--timeout-s 5400] \\
        [--model data/mini-k3-chat] [--prefill-pause-s 10] \\
        --out benchmarks/results/DATE/agent-resume.json

Many minutes of CPU on 2 cores: run it under nice.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _served.py: benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parent))  # agent_clients.py
from k3dist.config.deployment import Deployment  # noqa: E402

from _served import REPO, Served  # noqa: E402
from agent_clients import USER, _client_cmd, version  # noqa: E402

STOPPED = re.compile(
    r"request (\d+): the client went away; stopped on every rank at prompt token (\d+) of (\d+)"
)
CACHED = re.compile(r"request (\d+): (\d+) of (\d+) prompt tokens cached \(([^)]*)\)")
PROGRESS = re.compile(r"request (\d+): prefill (\d+) of (\d+) prompt tokens \((\d+) s\)")


def requests_seen(log: str, token_log: Path) -> list[dict]:
    """Every request of the run, from the server's log lines and rank 0's token log."""
    reqs: dict[int, dict] = {}

    def at(n: str) -> dict:
        return reqs.setdefault(int(n), {"request": int(n)})

    for n, c, total, source in CACHED.findall(log):
        at(n).update(prompt_tokens=int(total), cached_tokens=int(c), cached_from=source)
    for n, done, total, secs in PROGRESS.findall(log):
        # seconds: from the request's start to its last progress line (rank 0's log)
        at(n).update(prompt_tokens=int(total), prefilled_tokens=int(done), prefill_s=int(secs))
    for n, where, total in STOPPED.findall(log):
        at(n).update(prompt_tokens=int(total), stopped_at_prompt_token=int(where))
    if token_log.exists():
        for line in token_log.read_text().splitlines():
            e = json.loads(line)
            r = at(str(e["request"]))
            r.update(
                cached_tokens=e["cached"] or 0,
                generated_tokens=len(e["tokens"]),
                outcome=e["error"] or "finished",
            )
    return [reqs[k] for k in sorted(reqs)]


def _run(cmd: list[str], env: dict, work: Path, timeout_s: float) -> tuple:
    """The client, to its end or ``timeout_s``: (exit code or "timeout", stdout, stderr,
    seconds, the JSON lines of its stdout)."""
    t0 = time.monotonic()
    try:
        r = subprocess.run(
            cmd,
            env=env,
            cwd=work,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
        code, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        code, out, err = "timeout", e.stdout or "", e.stderr or ""
        out = out.decode() if isinstance(out, bytes) else out
        err = err.decode() if isinstance(err, bytes) else err
    took = time.monotonic() - t0
    events = []
    for line in out.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
    return code, out, err, took, events


def _work(tmp: Path) -> Path:
    work = tmp / "work"
    work.mkdir(parents=True, exist_ok=True)
    (work / "notes.txt").write_text("a file for the agent to list\n")
    return work


def run_claude(url: str, tmp: Path, max_output_tokens: int, timeout_s: float) -> dict:
    """Claude Code in its default mode (``-p``, no --bare), only its output cap set."""
    cmd, env = _client_cmd("claude", url, tmp)
    env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(max_output_tokens)
    code, out, err, took, events = _run(cmd, env, _work(tmp), timeout_s)
    result = next((e for e in reversed(events) if e.get("type") == "result"), None)
    (tmp / "claude-stdout.jsonl").write_text(out)
    (tmp / "claude-stderr.txt").write_text(err)
    keys = ("subtype", "is_error", "terminal_reason", "result", "num_turns", "duration_ms")
    return {
        "exit": code,
        "seconds": round(took, 1),
        "result": None if result is None else {k: result.get(k) for k in keys},
        # a turn that ended as Claude Code's own success, not with its error result
        "completed": result is not None
        and result.get("subtype") == "success"
        and not result.get("is_error"),
        "stderr_tail": err[-2000:],
    }


def run_codex(url: str, tmp: Path, timeout_s: float) -> dict:
    """Codex ``exec`` with its default tools and its own time-outs and retry counts: only
    the provider (this server, the Responses API) is named."""
    cmd, env = _client_cmd("codex", url, tmp, own_retries=True)
    code, out, err, took, events = _run(cmd, env, _work(tmp), timeout_s)
    (tmp / "codex-stdout.jsonl").write_text(out)
    (tmp / "codex-stderr.txt").write_text(err)
    kinds = [e.get("type") for e in events]
    said = [
        e["item"].get("text", "")[:300]
        for e in events
        if e.get("type") == "item.completed" and e.get("item", {}).get("type") == "agent_message"
    ]
    errors = [
        str(e.get("message") or e.get("error"))[:300]
        for e in events
        if "error" in str(e.get("type"))
    ]
    return {
        "exit": code,
        "seconds": round(took, 1),
        "events": dict(sorted({k: kinds.count(k) for k in set(kinds) if k}.items())),
        "agent_messages": said,
        "errors": errors,
        # Codex's own end of a turn: turn.completed, no turn.failed
        "completed": "turn.completed" in kinds and "turn.failed" not in kinds,
        "stderr_tail": err[-2000:],
    }


def model_ranks(src: Path, tmp: Path) -> str:
    """A Moonshot-format source folder (a mini variant: ``data/mini-k3-chat``) converted
    and sliced for 2 ranks under ``tmp``, as the embedded default is: the --rank-dir."""
    from k3dist.pipeline import convert, slicing

    build = convert.convert(src, tmp / "build", progress=False)
    for r in range(2):
        slicing.slice_rank(build, tmp / "ranks" / f"rank{r}", r, 2, None, progress=False)
    return str(tmp / "ranks" / "rank{rank}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--client", choices=["claude", "codex"], default="claude")
    ap.add_argument("--max-context", type=int, default=65536)
    ap.add_argument("--max-output-tokens", type=int, default=32)
    ap.add_argument("--timeout-s", type=float, default=5400, help="the whole client run")
    ap.add_argument(
        "--serve-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="more launch/serve.py flags (last on the line)",
    )
    ap.add_argument(
        "--scripted",
        action="store_true",
        help="the answer's tokens forced (tests/scripts/serve_scripted.py: a short answer "
        "that ends the message; the prefill is the trained mini's own; one request at a time)",
    )
    ap.add_argument(
        "--prefill-pause-s",
        type=float,
        default=0.0,
        help="every rank sleeps this long in each prefill chunk (tests/scripts/serve_paused.py): "
        "a prefill longer than the client's time-out, as a bigger model's on a slower box",
    )
    ap.add_argument(
        "--model",
        type=Path,
        help="a source folder to serve instead of the embedded default (e.g. "
        "data/mini-k3-chat, the mini that ends its messages: docs/minis.md)",
    )
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="agent-resume-"))
    token_log = tmp / "tokens-{rank}.jsonl"
    args = [
        "--max-context",
        str(a.max_context),
        "--no-warmup",
        "--token-log",
        str(token_log),
        *a.serve_args,
    ]
    entry = REPO / "launch/serve.py"
    rank_dir = Deployment().rank_dir if a.model is None else model_ranks(a.model, tmp / "model")
    if a.model is not None:
        args += ["--rank-dir", rank_dir]
    if a.prefill_pause_s:
        if a.scripted:
            ap.error("--prefill-pause-s and --scripted: one entry script or the other")
        entry = REPO / "tests/scripts/serve_paused.py"
        args += ["--prefill-pause-s", str(a.prefill_pause_s)]
    if a.scripted:  # its logits processor follows the latest request: one at a time
        entry = REPO / "tests/scripts/serve_scripted.py"
        args += ["--rank-dir", rank_dir, "--max-batch", "1"]
    report: dict = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "client": {"name": a.client, "version": version(a.client), "user": USER},
        "client_env_set": {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(a.max_output_tokens)}
        if a.client == "claude"
        else {},
        "model": str(a.model) if a.model else "k3dist/data/mini-k3 (the embedded default)",
        "serve_args": args,
        "prefill_pause_s": a.prefill_pause_s,
        "answer": "scripted (the mini's tokens forced to a short answer)"
        if a.scripted
        else "the mini's own (greedy)",
        "work_dir": str(tmp),
    }
    loads: list[float] = []  # the 1-minute load average every 30 s of the run
    done = threading.Event()

    def sample() -> None:
        while not done.wait(30):
            loads.append(round(os.getloadavg()[0], 2))

    threading.Thread(target=sample, daemon=True).start()
    srv = Served(tmp / "serve", args, entry=entry)
    try:
        report["server_ready_s"] = round(srv.ready_s, 1)
        if a.client == "claude":
            run = run_claude(srv.url, tmp / "claude", a.max_output_tokens, a.timeout_s)
        else:
            run = run_codex(srv.url, tmp / "codex", a.timeout_s)
        time.sleep(2)  # rank 0's last lines through mlx.launch
        reqs = requests_seen(srv.output(), Path(str(token_log).format(rank=0)))
    finally:
        srv.stop()
        done.set()
    big = [r for r in reqs if r.get("prompt_tokens", 0) >= 1000]  # the turn, not side calls
    report.update(
        run=run,
        requests=reqs,
        attempts=len(big),
        resumed_from=[r.get("cached_tokens", 0) for r in big],
        stopped_at=[r.get("stopped_at_prompt_token") for r in big],
        total_s=run["seconds"],
        loadavg_end=os.getloadavg(),
        loadavg_1min_during={
            "samples": len(loads),
            "mean": round(sum(loads) / len(loads), 2) if loads else None,
            "max": max(loads, default=None),
        },
    )
    text = json.dumps(report, indent=1)
    if a.out:
        a.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
