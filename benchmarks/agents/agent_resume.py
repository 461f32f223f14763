"""Claude Code's default mode, unmodified, against the 2-rank trained mini with a 64K
context, until a turn completes (issue 41): its full request (system prompt and default
tools, ~28K tokens) takes longer to prefill on a small CPU box than the client waits, so
it gives up and sends the same request again; each retry resumes the prefill its
predecessor left in the prompt cache. Only Claude Code's own output cap is set
(``CLAUDE_CODE_MAX_OUTPUT_TOKENS``: the mini never stops on its own); no time-out is
raised. Reports each request the server saw (prompt tokens, cached tokens it resumed
from, where it stopped or that it finished), the client's exit and result, and the
total time.

    nice -n 10 python benchmarks/agents/agent_resume.py [--max-context 65536] \\
        [--max-output-tokens 32] [--timeout-s 5400] \\
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _served.py: benchmarks/
from _served import Served  # noqa: E402
from agent_clients import USER, _client_cmd, version  # noqa: E402

STOPPED = re.compile(
    r"request (\d+): the client went away; stopped on every rank at prompt token (\d+) of (\d+)"
)
CACHED = re.compile(r"request (\d+): (\d+) of (\d+) prompt tokens cached \(([^)]*)\)")
PROGRESS = re.compile(r"request (\d+): prefill (\d+) of (\d+) prompt tokens")


def requests_seen(log: str, token_log: Path) -> list[dict]:
    """Every request of the run, from the server's log lines and rank 0's token log."""
    reqs: dict[int, dict] = {}

    def at(n: str) -> dict:
        return reqs.setdefault(int(n), {"request": int(n)})

    for n, c, total, source in CACHED.findall(log):
        at(n).update(prompt_tokens=int(total), cached_tokens=int(c), cached_from=source)
    for n, done, total in PROGRESS.findall(log):
        at(n).update(prompt_tokens=int(total), prefilled_tokens=int(done))
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


def run_client(url: str, tmp: Path, max_output_tokens: int, timeout_s: float) -> dict:
    """Claude Code in its default mode (``-p``, no --bare), only its output cap set."""
    cmd, env = _client_cmd("claude", url, tmp)
    env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(max_output_tokens)
    work = tmp / "work"
    work.mkdir(parents=True, exist_ok=True)
    (work / "notes.txt").write_text("a file for the agent to list\n")
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
    result = next((e for e in reversed(events) if e.get("type") == "result"), None)
    (tmp / "claude-stdout.jsonl").write_text(out)
    (tmp / "claude-stderr.txt").write_text(err)
    return {
        "exit": code,
        "seconds": round(took, 1),
        "result": None
        if result is None
        else {
            k: result.get(k)
            for k in (
                "subtype",
                "is_error",
                "terminal_reason",
                "result",
                "num_turns",
                "duration_ms",
                "duration_api_ms",
            )
        },
        # a turn that ended as Claude Code's own success, not with its error result
        "completed": result is not None
        and result.get("subtype") == "success"
        and not result.get("is_error"),
        "stderr_tail": err[-2000:],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-context", type=int, default=65536)
    ap.add_argument("--max-output-tokens", type=int, default=32)
    ap.add_argument("--timeout-s", type=float, default=5400, help="the whole client run")
    ap.add_argument(
        "--serve-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="more launch/serve.py flags (last on the line)",
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
    report: dict = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "client": {"name": "claude", "version": version("claude"), "user": USER},
        "client_env_set": {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(a.max_output_tokens)},
        "serve_args": args,
        "work_dir": str(tmp),
    }
    srv = Served(tmp / "serve", args)
    try:
        report["server_ready_s"] = round(srv.ready_s, 1)
        run = run_client(srv.url, tmp / "claude", a.max_output_tokens, a.timeout_s)
        time.sleep(2)  # rank 0's last lines through mlx.launch
        reqs = requests_seen(srv.output(), Path(str(token_log).format(rank=0)))
    finally:
        srv.stop()
    big = [r for r in reqs if r.get("prompt_tokens", 0) >= 1000]  # the turn, not side calls
    report.update(
        run=run,
        requests=reqs,
        attempts=len(big),
        resumed_from=[r.get("cached_tokens", 0) for r in big],
        stopped_at=[r.get("stopped_at_prompt_token") for r in big],
        total_s=run["seconds"],
        loadavg_end=os.getloadavg(),
    )
    text = json.dumps(report, indent=1)
    if a.out:
        a.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
