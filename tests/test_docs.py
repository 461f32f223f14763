"""README.md and docs/*.md as a reader meets them.

- Every figure (README, docs/, deploy/tb5.yaml's comments) that comes from a measurement
  or a plan is listed in FIGURES with its source (a results file and key, or the code that
  defines it) and rendered from it: a figure that drifts from its source fails here.
  Every number with a unit in README.md is one of them or a stated constant
  (README_CONSTANTS).
- Every fenced block has a language; every command block (sh, console, bash, shell) says
  on the line before it how the suite runs it: `<!-- run: as written -->` (from the
  checkout, seconds), `<!-- run: flags -->` (each k3dist command's flags against its own
  --help), `<!-- tested by: tests/FILE.py::TEST -->`, or `<!-- not run: REASON -->` (one
  line: why it cannot run here).
- The README's two-Mac guide: every command in its table is checked the same way, and the
  names, addresses, ports, key and wired limit it uses are those of the hostfile,
  deployment, pf anchor and planner it names.
- The disk plan the docs quote is what the code plans now (benchmarks/pipeline/disk_plan.py).
- docs/layout.md says what each layer imports; links and anchors resolve; the agent
  recipes carry what each client needs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest
import yaml
from doc_blocks import (
    COMMAND_LANGS,
    FENCE,
    README,
    REPO,
    Block,
    blocks,
    guide_commands,
    guide_marker,
    guide_table,
    marker_test,
    simple_commands,
)

DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
BIN = REPO / ".venv" / "bin"
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]

# Programs a command may run that are not k3dist's: checked by what the guide test below
# asserts of their arguments, never run here (macOS, root, another machine or the network).
EXTERNAL = {
    "sudo": "root",
    "systemsetup": "macOS",
    "networksetup": "macOS",
    "sysctl": "macOS (iogpu)",
    "pfctl": "macOS (pf)",
    "ssh-copy-id": "another machine",
    "ssh-keygen": "the user's ssh key",
    "ssh": "another machine",
    "ping": "another machine",
    "rsync": "another machine",
    "curl": "a running server",
    "openssl": "writes the user's key",
    "chmod": "the key's mode",
    "cp": "system files",
    "tee": "system files",
    "printf": "system files",
    "echo": "system files",
    "cat": "the user's key",
    "cd": "the user's checkout",
    "export": "the user's shell",
    "claude": "an agent client (npm)",
    "codex": "an agent client (npm)",
    "aider": "an agent client (PyPI)",
    "apt-get": "root",
    "rdma_ctl": "macOS Recovery",
    "scripts/setup": "installs packages (.ci/run runs it)",
}


# -- the documents ---------------------------------------------------------------------


def command_blocks() -> list[Block]:
    return [b for p in DOCS for b in blocks(p) if b.lang in COMMAND_LANGS]


# -- commands --------------------------------------------------------------------------


def _k3dist_parts(cmd: list[str]) -> list[tuple[tuple[str, ...], list[str]]] | None:
    """[(the --help command line, the arguments to check against it)] for a command that
    runs k3dist, or None for another program."""
    prog = cmd[0]
    if prog.startswith(".venv/bin/k3dist-"):
        name = prog.rsplit("/", 1)[1]
        assert name in SCRIPTS, f"{name}: no such console script (pyproject.toml)"
        head = (prog, *cmd[1:2]) if len(cmd) > 1 and not cmd[1].startswith("-") else (prog,)
        if name != "k3dist-checkpoint":
            head = (prog,)
        return [(head, cmd[len(head) :])]
    if prog == ".venv/bin/python":
        if cmd[1] == "-m":
            return [((prog, "-m", cmd[2]), cmd[3:])]
        script = cmd[1]
        assert (REPO / script).is_file(), f"{script}: no such script"
        if script == "launch/run.py" and "--" in cmd:
            i = cmd.index("--")
            return [((prog, script), cmd[2:i]), ((prog, cmd[i + 1]), cmd[i + 2 :])]
        return [((prog, script), cmd[2:])]
    if prog.startswith(".venv/bin/"):
        assert (REPO / prog).exists() or prog == ".venv/bin/mlx.launch", prog
        return []
    return None


@cache
def help_text(head: tuple[str, ...]) -> str:
    """What `HEAD --help` prints, run in this process (the imports paid once): a console
    script's function, a `python -m` module or a script run as __main__."""
    import contextlib
    import importlib
    import io
    import runpy

    if head[0].startswith(".venv/bin/k3dist-"):
        module, func = SCRIPTS[head[0].rsplit("/", 1)[1]].split(":")
        run, argv0 = getattr(importlib.import_module(module), func), head[0]
    elif head[1] == "-m":
        run, argv0 = (lambda: runpy.run_module(head[2], run_name="__main__")), head[2]
    else:
        path = str(REPO / head[1])
        run, argv0 = (lambda: runpy.run_path(path, run_name="__main__")), path
    out, argv, path0 = io.StringIO(), sys.argv, list(sys.path)
    sys.argv = [argv0, "--help"]
    if head[0].startswith(".venv/bin/k3dist-"):
        sys.argv = [argv0, *head[1:], "--help"]
    elif head[1] != "-m":
        sys.path.insert(0, str(Path(path).parent))
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
            run()
    finally:
        sys.argv, sys.path[:] = argv, path0
    assert e.value.code in (0, None), f"{' '.join(head)} --help exited {e.value.code}"
    return out.getvalue()


def _env() -> dict:
    return dict(os.environ, PATH=f"{BIN}:{Path(sys.executable).parent}:{os.environ['PATH']}")


def check_flags(text: str, where: str) -> None:
    """Every command in text: a k3dist one exists and takes every --flag it is given;
    another program is one of EXTERNAL."""
    work = []
    for cmd in simple_commands(text):
        parts = _k3dist_parts(cmd)
        if parts is None:
            assert cmd[0] in EXTERNAL, f"{where}: {cmd[0]} is neither k3dist's nor EXTERNAL"
            continue
        work += parts
    helps = [help_text(head) for head, _ in work]
    for (head, args), h in zip(work, helps, strict=True):
        for a in args:
            if a.startswith("--"):
                flag = a.split("=", 1)[0]
                assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", h), (
                    f"{where}: {' '.join(head)} takes no {flag}"
                )


# -- blocks ----------------------------------------------------------------------------


def test_readme_is_at_most_250_lines():
    assert len(README.read_text().splitlines()) <= 250


def test_every_fence_says_its_language():
    bare = [str(b) for p in DOCS for b in blocks(p) if not b.lang]
    assert not bare, f"fences without a language (```sh, ```json, ```text, ...): {bare}"


@pytest.mark.parametrize("block", command_blocks(), ids=str)
def test_command_block_runs_or_says_why(block: Block):
    if block.mark == "not run":
        assert len(block.arg) >= 15, f"{block}: say why it cannot run here"
    elif block.mark == "tested by":
        path, name, _ = marker_test(block.arg)
        assert (REPO / path).is_file() and f"def {name}(" in (REPO / path).read_text(), (
            f"{block}: no test {block.arg}"
        )
    elif block.mark == "run" and block.arg == "flags":
        check_flags(block.body, str(block))
    else:
        assert block.mark == "run" and block.arg == "as written", (
            f"{block}: say on the line before it how the suite runs it: <!-- run: as written -->, "
            "<!-- run: flags -->, <!-- tested by: tests/FILE.py::TEST --> or "
            "<!-- not run: REASON -->"
        )
        r = subprocess.run(
            ["bash", "-ec", block.body],
            cwd=REPO,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert r.returncode == 0, f"{block}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"


def test_the_two_commands_are_what_ci_runs():
    readme = [b.body.strip() for b in blocks(README) if b.lang in COMMAND_LANGS]
    setup_and_serve, tests = readme[0], readme[1]
    assert setup_and_serve.startswith("scripts/setup && ")
    ci = [x for x in (REPO / ".ci" / "run").read_text().splitlines() if x and not x.startswith("#")]
    assert "scripts/setup" in ci, ".ci/run installs through README's scripts/setup"
    assert ci[-1] == tests, ".ci/run's last line is README's test command"
    assert os.access(REPO / "scripts" / "setup", os.X_OK)


def test_links_resolve():
    missing = []
    for p in [*DOCS, REPO / "benchmarks" / "README.md", REPO / "hostfiles" / "README.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", p.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue
            f = (p.parent / target).resolve()
            if not f.exists():
                missing.append(f"{p.relative_to(REPO)} -> {target}")
    assert not missing, missing


# -- the two-Mac guide -----------------------------------------------------------------


def test_guide_table_says_which_test_runs_it():
    """The checklist table's marker names the rig test that runs its commands
    (tests/two_macs.py: each one run or given its one-line reason)."""
    mark, arg = guide_marker()
    assert mark == "tested by", "README: a <!-- tested by: ... --> line before the checklist"
    path, name, subs = marker_test(arg)
    assert f"def {name}(" in (REPO / path).read_text(), arg
    assert subs, "the marker says what the rig substitutes"


def test_guide_commands_are_checked():
    cmds = guide_commands()
    assert len(cmds) >= 12
    for c in cmds:
        check_flags(c, f"README guide: {c}")


def test_guide_matches_hostfile_deployment_firewall_and_planner():
    from k3dist.pipeline import byte_budget
    from k3dist.serve import peer_link

    hosts = json.loads((REPO / "hostfiles" / "tb5.json").read_text())["hosts"]
    jaccl = json.loads((REPO / "hostfiles" / "tb5-jaccl.json").read_text())["hosts"]
    assert [h["ssh"] for h in hosts] == [h["ssh"] for h in jaccl]
    ssh = [h["ssh"] for h in hosts]
    ips = [h["ips"][0] for h in hosts]
    dep = yaml.safe_load((REPO / "deploy" / "tb5.yaml").read_text())
    cmds = [c for text in guide_commands() for c in simple_commands(text)]

    def args_of(prog: str) -> list[list[str]]:
        return [c[1:] for c in cmds if c[0] == prog]

    # ssh: mlx.launch reaches every host by its hostfile name, the first Mac included
    assert [a[0] for a in args_of("ssh-copy-id")] == ssh
    # the bridge addresses are the hostfile's ips, rank by rank
    assert [a[2] for a in args_of("networksetup")] == ips
    assert args_of("ping")[0][-1] == ips[1]
    # rank 1's folder goes to rank 1's bridge address, where deploy/tb5.yaml reads it
    rsync = args_of("rsync")[0]
    src, dst = rsync[-2], rsync[-1]
    rank = dep["rank_dir"]
    assert args_of("ssh")[0] == [ips[1], "mkdir", "-p", str(Path(rank.format(rank=1)).parent)]
    assert src == rank.format(rank=1) + "/"
    assert dst == f"{ips[1]}:{rank.format(rank=1)}/"
    # the pipeline writes what the deployment serves, at the planner's default budget
    pipe = next(c for c in cmds if c[0] == ".venv/bin/k3dist-pipeline")
    assert pipe[pipe.index("--src") + 1] == dep["build"]
    assert rank.startswith(pipe[pipe.index("--out") + 1] + "/")
    assert not {"--budget", "--budget-total", "--target-bpw"} & set(pipe), (
        "the guide builds the plan the quality tables measure: the planner's default budget"
    )
    # the wired limit the planner budgets with, now and after a reboot
    mb = byte_budget.Box().wired_limit_mb
    assert args_of("sysctl")[0] == [f"iogpu.wired_limit_mb={mb}"]
    assert args_of("echo")[0] == [f"iogpu.wired_limit_mb={mb}"]
    assert args_of("tee")[0] == ["-a", "/etc/sysctl.conf"]
    # the key the deployment names, made on the first Mac only
    key_row = next(r for r in guide_table() if "openssl rand" in r[2])
    assert key_row[1] == "Mac 1"
    assert dep["api_key_file"] in key_row[2]
    # the firewall anchor: the bridge's peers, the ring ports and the watchdog's
    pf = (REPO / "deploy" / "pf.k3dist").read_text()
    peers = re.search(r'peers = "\{ (.*) \}"', pf).group(1).split(", ")
    assert peers == ips
    lo, hi = map(int, re.search(r"port (\d+):(\d+)\n", pf).groups())
    base = peer_link.DEFAULT_RING_PORT
    assert lo <= base and base + dep["size"] - 1 <= hi and lo <= base + 1000 <= hi
    assert "block in quick proto tcp from any to any port" in pf
    assert f"port {lo}:{hi}" in pf.split("block in quick")[1]
    # serve on the first Mac with the hostfile and the deployment; health on its port
    serve = next(c for c in cmds if c[:2] == [".venv/bin/python", "launch/run.py"])
    assert serve[serve.index("--hostfile") + 1] == "hostfiles/tb5.json"
    assert serve[serve.index("--config") + 1] == "deploy/tb5.yaml"
    urls = [next(x for x in a if x.startswith("http")) for a in args_of("curl")]
    assert urls == [
        f"http://{ips[0]}:{dep['port']}/health",
        f"http://{ips[0]}:{dep['port']}/v1/models",
    ]
    assert "--no-agents" in (REPO / "scripts" / "setup").read_text()


# -- figures ---------------------------------------------------------------------------


def _json(path: str) -> dict:
    return json.loads((REPO / path).read_text())


def _at(d, key: str):
    for k in key.split("."):
        d = d[int(k)] if isinstance(d, list) else d[k]
    return d


def gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB"


def gb2(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def tb(x: float) -> str:
    return f"{x / 1e12:.3f} TB"


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def secs(x: float, nd: int = 1) -> str:
    return f"{x:.{nd}f} s"


DISK = "benchmarks/results/2026-12-05/disk-plan-k3.json"
PROJECT = "benchmarks/results/2026-12-05/project.json"
SPEED = "benchmarks/results/2026-12-06/speed.json"
REHEARSAL = "benchmarks/results/2026-12-04/rehearsal-pipeline.json"
SERVE93 = "benchmarks/results/2026-12-04/rehearsal-serve.json"
AGENTS = "benchmarks/results/2026-12-02/agent-clients.json"
PREFIX = "benchmarks/results/2026-12-03/prefix-cache.json"
PREFILL = "benchmarks/results/2026-12-03/project-prefill.json"
VISION = "benchmarks/results/2026-12-02/vision-memory.json"
VERIFY = "benchmarks/results/2026-12-01/verify-rate.json"
RESUME = "benchmarks/results/2026-12-06/agent-resume-shipped.json"
RETRY = "benchmarks/results/2026-12-06/resume-retry.json"
SCRIPTED = "benchmarks/results/2026-12-06/agent-resume-scripted.json"
CODEX = "benchmarks/results/2026-12-06/agent-resume-codex-shipped.json"
CODEX_SCRIPTED = "benchmarks/results/2026-12-06/agent-resume-codex-scripted.json"
CHAT_RESUME = "benchmarks/results/2026-12-06/agent-resume.json"  # data/mini-k3-chat
CHAT_CODEX = "benchmarks/results/2026-12-06/agent-resume-codex.json"
CHAT_SLOW = "benchmarks/results/2026-12-06/agent-resume-slow.json"  # --prefill-pause-s
SOAK = "benchmarks/results/2026-12-06/soak.json"


def _pipeline_s(dwq: bool) -> float:
    stages = _json(REHEARSAL)["stages"]
    return sum(s["real_k3"]["total_s"] for s in stages if dwq or s["stage"] != "dwq")


def _wired_mb() -> int:
    from k3dist.pipeline import byte_budget

    return byte_budget.Box().wired_limit_mb


def _experts() -> int:
    return _json("k3dist/data/kimi-k3-config.json")["text_config"]["num_experts"]


def _default(key: str):
    from k3dist.config.deployment import Deployment

    return Deployment.model_fields[key].default


def _resumed_once(path: str, first: int) -> int:
    """The tokens every request from ``first`` on resumed from (one value, or fails)."""
    (n,) = set(_json(path)["resumed_from"][first:])
    return n


def _rest(path: str, i: int) -> int:
    """The prompt tokens request ``i`` prefilled past those it resumed from."""
    r = _json(path)["requests"][i]
    return r["prompt_tokens"] - r["cached_tokens"]


def F(docs, template: str, *sources):
    """A figure: template with one {} per source; a source is (file, key, format) or
    (callable, format)."""
    return (docs, template, sources)


CABLE = "benchmarks/results/2026-12-06/cable-faults.json"
R, B = ("README.md",), ("docs/build.md",)
RB = ("README.md", "docs/build.md")
_TTFT = "prefill.mxfp4.jaccl.cached_prefix.20480"
_NEW64 = _TTFT + ".ttft.headline.{}.new_turn_64.ttft_cached_s"
NBOXES = "benchmarks/results/2026-12-06/nboxes-table.json"


def _nboxes_row(i: int) -> str:
    """Row ``i`` of docs/n-boxes.md's buyer's table, as benchmarks/speed/nboxes_table.py
    renders it."""
    import runpy

    script = runpy.run_path(str(REPO / "benchmarks" / "speed" / "nboxes_table.py"))
    return script["markdown_row"](_json(NBOXES)["rows"][i])


def _nbox(name: str, key: str):
    """``key`` of the buyer's table row for the set ``name`` (e.g. "3x256")."""
    return _at(next(r for r in _json(NBOXES)["rows"] if r["set"] == name), key)


def _grid_kl(row_id: str) -> float:
    """A measured quality-grid row's mean KL (k3dist/data/quality-grid.json)."""
    return next(
        r["kl"] for r in _json("k3dist/data/quality-grid.json")["rows"] if r["id"] == row_id
    )


def _nb(name: str, key: str, fmt="{:.2f}".format):
    return (lambda: _nbox(name, key), fmt)


NB = ("docs/n-boxes.md",)
PAR3 = "benchmarks/results/2026-12-06/rehearsal-parity-3-boxes.json"
PAR4 = "benchmarks/results/2026-12-06/rehearsal-parity-4-boxes.json"
PARMINI = "benchmarks/results/2026-12-06/rehearsal-parity-mini.json"


def _rehearsal_row(n: int) -> str:
    """docs/n-boxes.md's rehearsal row for ``n`` boxes, from its two results files."""
    pipe = _json(f"benchmarks/results/2026-12-06/rehearsal-pipeline-{n}-boxes.json")
    serve = _json(f"benchmarks/results/2026-12-06/rehearsal-serve-{n}-boxes.json")
    par = serve["parity"]
    ranks = "equal" if all(o == par["served"] for o in par["other_ranks"]) else "differ"
    one = "equal" if par["equal"] else "differ"
    folders = ", ".join(f"{b / 1e6:.0f}" for b in pipe["disk_plan_preset"]["rank_folders"])
    if "requests" in serve:
        q, logs = serve["requests"], serve["token_logs"]
        done = f"{q['answered_200']} of {q['sent']}"
        same = f"{'identical' if logs['identical'] else 'differ'}, {logs['compared']} entries"
    else:
        done, same = f"stopped after {serve['phase']}", ""
    same = f" {same} |" if same else " |"
    return f"{folders} | {serve['ready_s']:.0f} s | {ranks} | {one} | {done} |{same}"


FIGURES = [
    # the K3-count rehearsal against one process: rounding amplified by the synthetic build
    F(
        NB,
        "by up to {} (top-1 {})",
        (PAR3, "sensitivity.0.max_abs_logprob_change", "{:.1f}".format),
        (PAR3, "sensitivity.0.top1_held", lambda h: "held" if h else "changed"),
    ),
    F(
        NB,
        "log-probability difference {} at 3 ranks, {} at 4 ranks",
        (PAR3, "max_abs_logprob_diff", "{:.2f}".format),
        (PAR4, "max_abs_logprob_diff", "{:.2f}".format),
    ),
    F(
        NB,
        "same two measurements are {} (2 ranks against one process) and {} (the 1e-7",
        (PARMINI, "max_abs_logprob_diff", "{:.2e}".format),
        (PARMINI, "sensitivity.0.max_abs_logprob_change", "{:.2e}".format),
    ),
    *[F(NB, "{}", (lambda i=i: _nboxes_row(i), str)) for i in range(len(_json(NBOXES)["rows"]))],
    F(NB, "| 512+256+256 | {}", (lambda: _rehearsal_row(3), str)),
    F(NB, "| 4x256 | {}", (lambda: _rehearsal_row(4), str)),
    F(
        NB,
        "side by side on this machine's 2 cores at load {} to {}",
        (
            "benchmarks/results/2026-12-06/rehearsal-pipeline-3-boxes.json",
            "loadavg_1m.start",
            "{:.1f}".format,
        ),
        (
            "benchmarks/results/2026-12-06/rehearsal-pipeline-3-boxes.json",
            "loadavg_1m.end",
            "{:.1f}".format,
        ),
    ),
    # the buyer's table in words (README's requirements line, docs/n-boxes.md)
    F(
        R,
        "512 + 256 GB at {} expert bits a weight, three 256 GB Macs at {}, four at {}, "
        "512 + 256 + 256 GB at {}, three 512 GB at {}",
        _nb("512+256", "expert_bpw"),
        _nb("3x256", "expert_bpw"),
        _nb("4x256", "expert_bpw"),
        _nb("512+256+256", "expert_bpw"),
        _nb("3x512", "expert_bpw"),
    ),
    F(
        R,
        "bound); two 256 GB Macs {}.",
        _nb("2x256", "fits", lambda f: "hold K3" if f else "do not hold K3"),
    ),
    F(
        R,
        "three 512 GB at {} ({} the measured quality grid",
        _nb("3x512", "expert_bpw"),
        _nb("3x512", "kl_from", lambda k: "past" if k == "extrapolated" else "inside"),
    ),
    F(NB, "issues the same {} collectives a token", _nb("2x512", "collectives_per_token", str)),
    F(
        NB,
        "the 1-bit g64 rows at {} and {} bpw, where 512+256 ({}) and three 256 GB Macs ({})",
        _nb("3x256", "grid_rows_bpw.0"),
        _nb("3x256", "grid_rows_bpw.1"),
        _nb("512+256", "expert_bpw"),
        _nb("3x256", "expert_bpw"),
    ),
    F(
        NB,
        "(measured KL {}), and three 256 GB Macs promote {} of the experts",
        (lambda: _grid_kl(_nbox("3x256", "grid_rows.0")), "{:.4f}".format),
        _nb("3x256", "promoted_share", pct),
    ),
    F(
        NB,
        "two measurements {} bpw apart",
        (
            lambda: _nbox("3x256", "grid_rows_bpw.1") - _nbox("3x256", "grid_rows_bpw.0"),
            "{:.2f}".format,
        ),
    ),
    F(NB, "Nothing is measured below {} bpw", _nb("3x256", "grid_rows_bpw.0")),
    F(
        NB,
        "two 512 GB Macs plan {} expert bpw (KL {}), 512+256+256 {} (KL {}) "
        "and four 256 GB {} (KL {})",
        _nb("2x512", "expert_bpw"),
        _nb("2x512", "kl_mean", "{:.4f}".format),
        _nb("512+256+256", "expert_bpw"),
        _nb("512+256+256", "kl_mean", "{:.4f}".format),
        _nb("4x256", "expert_bpw"),
        _nb("4x256", "kl_mean", "{:.4f}".format),
    ),
    F(
        NB,
        "768 GiB, 512+256 plans {} against three 256 GB Macs' {}",
        _nb("512+256", "expert_bpw"),
        _nb("3x256", "expert_bpw"),
    ),
    F(
        NB,
        "holds {} the routed-expert bytes of each 256 GiB box",
        _nb("512+256+256", "expert_bytes_per_box", lambda b: f"{b[0] / b[1]:.1f}x"),
    ),
    F(
        NB,
        "reads {} GB per token against {} GB (read ratio {} over the mean",
        _nb("512+256+256", "read_per_token_per_box.0", lambda x: f"{x / 1e9:.1f}"),
        _nb("512+256+256", "read_per_token_per_box.1", lambda x: f"{x / 1e9:.1f}"),
        _nb("512+256+256", "read_ratio"),
    ),
    F(
        NB,
        "for {} expert bpw. `--expert-split equal` gives each box the smallest box's "
        "room: equal reads but {}",
        _nb("512+256+256", "expert_bpw"),
        _nb("512+256+256, equal split", "expert_bpw"),
    ),
    F(
        NB,
        "projects the same decode at batch 1 ({} tok/s) and {} tok/s at batch 8 "
        "against {} with equal",
        _nb("512+256+256", "decode_b1_tok_s", "{:.1f}".format),
        _nb("512+256+256", "decode_b8_tok_s", "{:.1f}".format),
        _nb("512+256+256, equal split", "decode_b8_tok_s", "{:.1f}".format),
    ),
    # the real K3's plan and disk plan at the planner's default budget
    F(R, "a {} checkpoint", (DISK, "disk_plan.source_bytes", tb)),
    F(R, "| {} | download", (DISK, "disk_plan.source_bytes", tb)),
    F(R, "{} in `/Volumes/models/k3` at its peak", (DISK, "disk_plan.peak_out", gb)),
    F(RB, "{} with the source", (DISK, "disk_plan.peak_with_source", tb)),
    F(
        R,
        "peak {} ({} with the source)",
        (DISK, "disk_plan_dwq.peak_out", gb),
        (DISK, "disk_plan_dwq.peak_with_source", tb),
    ),
    F(
        B,
        "With `--dwq`: {} in OUT, {} with the source",
        (DISK, "disk_plan_dwq.peak_out", gb),
        (DISK, "disk_plan_dwq.peak_with_source", tb),
    ),
    F(B, "the peak in OUT {} during", (DISK, "disk_plan.peak_out", gb)),
    F(R, "{} free on the first Mac's disk", (DISK, "disk_plan_dwq.peak_with_source", tb)),
    F(R, "and {} on the second", (DISK, "disk_plan.rank_folders.1", gb)),
    F(
        R,
        "({} and {})",
        (DISK, "disk_plan.rank_folders.0", gb),
        (DISK, "disk_plan.rank_folders.1", gb),
    ),
    F(R, "| {} on Mac 2 |", (DISK, "disk_plan.rank_folders.1", gb)),
    F(R, "loading ~{} a Mac", (DISK, "disk_plan.rank_folders.0", gb)),
    F(
        B,
        "rank folders {} (rank 0, with the vision tower) and {}",
        (DISK, "disk_plan.rank_folders.0", gb),
        (DISK, "disk_plan.rank_folders.1", gb),
    ),
    F(
        R,
        "routed experts at {} bits a weight, a {} lo bank with {} of the experts",
        (DISK, "plan.expert_bpw", "{:.2f}".format),
        (DISK, "plan.lo.format", str),
        (DISK, "plan.promoted_fraction", pct),
    ),
    F(
        B,
        "lo bank {}, {} of the\nrouted experts kept in MXFP4, routed experts at {} bits",
        (DISK, "plan.lo.format", str),
        (DISK, "plan.promoted_fraction", pct),
        (DISK, "plan.expert_bpw", "{:.2f}".format),
    ),
    # the pipeline's time on an M3 Ultra: projected from the 93-layer rehearsal
    F(R, "| {} (projected);", (lambda: _pipeline_s(False), lambda s: f"~{s / 60:.0f} min")),
    F(R, "; {} with `--dwq` |", (lambda: _pipeline_s(True), lambda s: f"~{s / 3600:.1f} h")),
    F(R, "projected {} in all", (lambda: _pipeline_s(True), lambda s: f"~{s / 3600:.1f} h")),
    F(B, "{} without DWQ", (lambda: _pipeline_s(False), lambda s: f"~{s / 60:.0f} min")),
    F(B, "{} with DWQ", (lambda: _pipeline_s(True), lambda s: f"~{s / 3600:.1f} h")),
    # the wired limit the planner budgets with
    F(R, "what the plan budgets ({})", (_wired_mb, lambda mb: f"{mb // 1024} GiB")),
    F(R, "sudo sysctl iogpu.wired_limit_mb={}`", (_wired_mb, str)),
    F(R, "echo iogpu.wired_limit_mb={} ", (_wired_mb, str)),
    # projected decode, the default plan, attention split (deploy/tb5.yaml), batch 1, 2K:
    # the calibrated table's backend rows (docs/speed.md, the same figures)
    F(
        R,
        "{} on ring,\n{} on JACCL",
        (SPEED, "defaults.backend.rows.0.decode_b1_2k_tok_s", "{:.2f} tok/s".format),
        (SPEED, "defaults.backend.rows.1.decode_b1_2k_tok_s", "{:.2f} tok/s".format),
    ),
    # the 93-layer rehearsal
    F(RB, "{} tensors", (REHEARSAL, "real_k3.tensors", "{:,}".format)),
    F(
        R,
        "{} of {} requests answered",
        (SERVE93, "requests.answered_200", str),
        (SERVE93, "requests.sent", str),
    ),
    F(
        B,
        "{} of {} requests answered",
        (SERVE93, "requests.answered_200", str),
        (SERVE93, "requests.sent", str),
    ),
    F(R, "({} experts,", (_experts, str)),
    F(B, "{} routed experts top-16", (_experts, str)),
    # coding agents
    F(
        ("docs/serving.md",),
        "Claude Code sends a {}-token prompt and asks\nfor {} output tokens",
        (AGENTS, "clients.claude.count_tokens", "{:,}".format),
        (AGENTS, "clients.claude.max_tokens_sent", str),
    ),
    F(
        ("docs/serving.md",),
        "the default `max_context` ({})",
        (lambda: _default("max_context"), str),
    ),
    F(
        ("docs/serving.md",),
        "`max_context` ({}) holds them",
        (lambda: yaml.safe_load((REPO / "deploy/tb5.yaml").read_text())["max_context"], str),
    ),
    # an agent's retries and recoveries resume (docs/agents.md)
    F(
        ("docs/agents.md",),
        "load {} at its start and {} at its end",
        (RESUME, "loadavg_start.0", "{:.1f}".format),
        (RESUME, "loadavg_end.0", "{:.1f}".format),
    ),
    F(
        ("docs/agents.md",),
        "{} requests. Its first ({} tokens)",
        (RESUME, "attempts", str),
        (RESUME, "requests.0.prompt_tokens", "{:,}".format),
    ),
    F(
        ("docs/agents.md",),
        "at prompt token {}, and sent the same request again, which resumed from those {} tokens",
        (RESUME, "stopped_at.0", "{:,}".format),
        (RESUME, "resumed_from.1", "{:,}".format),
    ),
    F(
        ("docs/agents.md",),
        "recovery turns ({}, {} and {} tokens): each resumed from the {} tokens",
        (RESUME, "requests.2.prompt_tokens", "{:,}".format),
        (RESUME, "requests.3.prompt_tokens", "{:,}".format),
        (RESUME, "requests.4.prompt_tokens", "{:,}".format),
        (lambda: _resumed_once(RESUME, 2), "{:,}".format),
    ),
    F(
        ("docs/agents.md",),
        "prefilled the remaining {} to {}",
        (lambda: _rest(RESUME, 2), "{:,}".format),
        (lambda: _rest(RESUME, 4), "{:,}".format),
    ),
    F(
        ("docs/agents.md",),
        "complete), {} after it began",
        (RESUME, "total_s", "{:,.1f} s".format),
    ),
    F(
        ("docs/agents.md",),
        "`prefill_chunk` {}, load {} at its start",
        (RETRY, "prefill_chunk", str),
        (RETRY, "loadavg_start.0", "{:.1f}".format),
    ),
    F(
        ("docs/agents.md",),
        "a completion of {} tokens was hung up when {} were prefilled; the ranks stopped at "
        "prompt token {}; the same request sent again resumed from {} cached tokens, so it "
        "prefilled {} of the work already done again",
        (RETRY, "prompt_tokens", "{:,}".format),
        (RETRY, "hang_up.prefilled_tokens", "{:,}".format),
        (RETRY, "stopped_at_prompt_token", "{:,}".format),
        (RETRY, "retry_cached_tokens", "{:,}".format),
        (RETRY, "reprocessed_of_done", lambda n: "none" if n == 0 else f"{n:,} tokens"),
    ),
    F(
        ("docs/agents.md",),
        "and its {} greedy tokens {} those single-process mlx-lm",
        (RETRY, "uninterrupted_tokens", len),
        (RETRY, "resumed_equals_uninterrupted", lambda ok: "equal" if ok else "differ from"),
    ),
    F(
        ("docs/agents.md",),
        "agent-resume-scripted.json`, load {} at its start and {} at its end): {} request of {} "
        "tokens, prefilled whole",
        (SCRIPTED, "loadavg_start.0", "{:.1f}".format),
        (SCRIPTED, "loadavg_end.0", "{:.1f}".format),
        (SCRIPTED, "attempts", str),
        (SCRIPTED, "requests.0.prompt_tokens", "{:,}".format),
    ),
    F(
        ("docs/agents.md",),
        'result "{}", exit {}, {}.',
        (SCRIPTED, "run.result.result", str),
        (SCRIPTED, "run.exit", str),
        (SCRIPTED, "total_s", "{:,.1f} s".format),
    ),
    F(
        ("docs/agents.md",),
        "load {} at its start): its request of {} tokens was prefilled in one go",
        (CODEX, "loadavg_start.0", "{:.1f}".format),
        (CODEX, "requests.0.prompt_tokens", "{:,}".format),
    ),
    F(
        ("docs/agents.md",),
        "{} tokens were generated (the server's `max_tokens`: Codex sends no cap) and Codex "
        'failed the turn ("{}"), exit {}, {}.',
        (CODEX, "requests.0.generated_tokens", str),
        (CODEX, "run.errors.0", str),
        (CODEX, "run.exit", str),
        (CODEX, "total_s", "{:,.1f} s".format),
    ),
    F(
        ("docs/agents.md",),
        'load {} at its start) it completed its turn ("{}", `turn.completed`, exit {}) in {}.',
        (CODEX_SCRIPTED, "loadavg_start.0", "{:.1f}".format),
        (CODEX_SCRIPTED, "run.agent_messages.0", str),
        (CODEX_SCRIPTED, "run.exit", str),
        (CODEX_SCRIPTED, "total_s", "{:,.1f} s".format),
    ),
    # the chat mini: both clients' turns end with its own answer
    F(
        ("docs/agents.md",),
        "only\n`CLAUDE_CODE_MAX_OUTPUT_TOKENS={}` set (`benchmarks/results/2026-12-06/"
        "agent-resume.json`,\nload {} at the run's start and {} at its end): {} request of {} "
        "tokens, prefilled in {} s",
        (CHAT_RESUME, "client_env_set.CLAUDE_CODE_MAX_OUTPUT_TOKENS", str),
        (CHAT_RESUME, "loadavg_start.0", "{:.1f}".format),
        (CHAT_RESUME, "loadavg_end.0", "{:.1f}".format),
        (CHAT_RESUME, "attempts", str),
        (CHAT_RESUME, "requests.0.prompt_tokens", "{:,}".format),
        (CHAT_RESUME, "requests.0.prefill_s", str),
    ),
    F(
        ("docs/agents.md",),
        "then {} tokens generated, ending with the stop token;\nthe turn completed "
        '(`terminal_reason: {}`, result "{}"),\nexit {}, {}.',
        (CHAT_RESUME, "requests.0.generated_tokens", str),
        (CHAT_RESUME, "run.result.terminal_reason", str),
        (CHAT_RESUME, "run.result.result", str),
        (CHAT_RESUME, "run.exit", str),
        (CHAT_RESUME, "total_s", "{:,.1f} s".format),
    ),
    F(
        ("docs/agents.md",),
        "agent-resume-codex.json`, load {} at the run's start): {} request of\n{} tokens, {} "
        "tokens generated, `turn.completed` with the message",
        (CHAT_CODEX, "loadavg_start.0", "{:.1f}".format),
        (CHAT_CODEX, "attempts", str),
        (CHAT_CODEX, "requests.0.prompt_tokens", "{:,}".format),
        (CHAT_CODEX, "requests.0.generated_tokens", str),
    ),
    F(
        ("docs/agents.md",),
        'directory.", exit {}, {}. The answer',
        (CHAT_CODEX, "run.exit", str),
        (CHAT_CODEX, "total_s", "{:,.1f} s".format),
    ),
    F(
        ("docs/agents.md",),
        "every prefill chunk slowed by {} s on\nevery rank (`--prefill-pause-s {}`",
        (CHAT_SLOW, "prefill_pause_s", "{:.0f}".format),
        (CHAT_SLOW, "prefill_pause_s", "{:.0f}".format),
    ),
    F(
        ("docs/agents.md",),
        "agent-resume-slow.json`,\nload {} at the run's start and {} at its end). Claude Code, "
        "unmodified but for\n`CLAUDE_CODE_MAX_OUTPUT_TOKENS={}`, sent its {}-token request {} "
        "times: the first was\ngiven up at prompt token {}; the second resumed from those {} "
        "tokens",
        (CHAT_SLOW, "loadavg_start.0", "{:.1f}".format),
        (CHAT_SLOW, "loadavg_end.0", "{:.1f}".format),
        (CHAT_SLOW, "client_env_set.CLAUDE_CODE_MAX_OUTPUT_TOKENS", str),
        (CHAT_SLOW, "requests.0.prompt_tokens", "{:,}".format),
        (CHAT_SLOW, "attempts", str),
        (CHAT_SLOW, "stopped_at.0", "{:,}".format),
        (CHAT_SLOW, "resumed_from.1", "{:,}".format),
    ),
    F(
        ("docs/agents.md",),
        "and was given up at {}; the third resumed from {}, finished the\nprefill, generated {} "
        'tokens ending with the stop token, and the turn completed (result\n"{}", exit {}) {} '
        "after it began",
        (CHAT_SLOW, "stopped_at.1", "{:,}".format),
        (CHAT_SLOW, "resumed_from.2", "{:,}".format),
        (CHAT_SLOW, "requests.2.generated_tokens", str),
        (CHAT_SLOW, "run.result.result", str),
        (CHAT_SLOW, "run.exit", str),
        (CHAT_SLOW, "total_s", "{:,.1f} s".format),
    ),
    F(
        ("docs/agents.md",),
        "`benchmarks/faults/soak.py {}`, a shorter run than the 30-minute one with more requests "
        "hung up, load {}",
        (SOAK, "command", lambda c: c.split("soak.py ", 1)[1].split(" --out", 1)[0]),
        (SOAK, "loadavg.0", "{:.1f}".format),
    ),
    F(
        ("docs/agents.md",),
        "{} requests, {} of them hung up part-way by the client, {} lost and {} mismatches",
        (SOAK, "requests", str),
        (SOAK, "outcomes.abandoned", str),
        (SOAK, "lost", str),
        (SOAK, "mismatches", str),
    ),
    F(
        ("docs/agents.md",),
        "Claude Code's default mode sends {} tools and a\n{}-token prompt, Codex `exec` {} tools",
        (AGENTS, "clients.claude.tools", str),
        (AGENTS, "clients.claude.count_tokens", "{:,}".format),
        (AGENTS, "clients.codex.tools", str),
    ),
    F(
        ("docs/agents.md",),
        "`keepalive_s` seconds (deployment key, `--keepalive-s`, default {};",
        (lambda: _default("keepalive_s"), "{:g}".format),
    ),
    # prefix caches and time to first token
    F(
        ("docs/prefix-cache.md",),
        "first turn of {} tokens took {} cold",
        (PREFIX, "turn_cold.prompt_tokens", str),
        (PREFIX, "turn_cold.ttft_s", secs),
    ),
    F(
        ("docs/prefix-cache.md",),
        "with {} tokens reused: {} warm in memory, "
        "{} restored from disk after a restart, {} preloaded",
        (PREFIX, "turn_warm_memory.cached_tokens", str),
        (PREFIX, "turn_warm_memory.ttft_s", lambda x: secs(x, 2)),
        (PREFIX, "turn_warm_after_restart.ttft_s", lambda x: secs(x, 2)),
        (PREFIX, "turn_warm_after_restart_preloaded.ttft_s", lambda x: secs(x, 2)),
    ),
    F(
        ("docs/prefix-cache.md",),
        "entry is {} bytes per cached token",
        (PREFIX, "bytes_per_cached_token_per_rank.0.0", "{:.0f}".format),
    ),
    F(
        ("docs/prefix-cache.md",),
        "prefix is {} a rank",
        (PREFILL, _TTFT + ".bytes_per_rank", lambda x: f"{x / 1e9:.2f} GB"),
    ),
    F(
        ("docs/prefix-cache.md",),
        "token in {} warm in memory, {} restored at the turn, "
        "{} preloaded at the start, against {} cold",
        (PREFILL, _NEW64.format("warm_in_memory"), "{:g} s".format),
        (PREFILL, _NEW64.format("restored_after_restart"), "{:g} s".format),
        (PREFILL, _NEW64.format("preloaded_at_restart"), "{:g} s".format),
        (PREFILL, _TTFT + ".ttft.headline.warm_in_memory.new_turn_64.ttft_cold_s", "{:g} s".format),
    ),
    # vision
    F(
        ("docs/vision.md",),
        "projector are {} in BF16",
        (VISION, "kimi_k3.tower_bf16", lambda x: f"{x / 1e9:.2f} GB"),
    ),
    F(
        ("docs/vision.md",),
        "the mini's {}",
        (VISION, "mini_k3.tower_bf16", lambda x: f"{x / 1e3:.0f} kB"),
    ),
    # deploy/tb5.yaml's comments: the default plan's bytes a rank
    F(
        ("deploy/tb5.yaml",),
        "plans {} of weights a rank",
        (
            DISK,
            "plan.bytes_per_rank",
            lambda b: f"{(b['nonexpert'] + b['routed_experts']) / 2**30:.2f} GiB",
        ),
    ),
    F(("deploy/tb5.yaml",), "KV {}.", (DISK, "plan.bytes_per_rank.kv_state", gb2)),
    F(("deploy/tb5.yaml",), "{} of activations", (DISK, "plan.bytes_per_rank.activations", gb2)),
    # idle
    F(
        ("docs/faults.md",),
        "| measured | {} | {} | {} | {} |",
        *(
            (
                "benchmarks/results/2026-12-02/idle-cpu.json",
                f"after.cpu_s_per_idle_minute.{p}",
                "{:.2f}".format,
            )
            for p in ("supervisor", "launcher", "rank0", "rank1")
        ),
    ),
    # the two-host rig's cable faults
    F(
        ("docs/two-hosts.md",),
        "({} chunks in {} s, the 50-chunk",
        (CABLE, "faults.flap.client.chunks", str),
        (CABLE, "faults.flap.client.s", str),
    ),
    F(
        ("docs/two-hosts.md",),
        "the restart swept them (half-written swept {})",
        (
            CABLE,
            "faults.prefixwrite.restart.prefix_cache",
            lambda c: str([x["swept_at_start"] for x in c]),
        ),
    ),
    # the weights check
    F(
        B,
        "restart took {} here ({}\nsparse files)",
        (VERIFY, "real_scale_stamp.seconds_incl_manifest_parse", lambda x: f"{x * 1e3:.0f} ms"),
        (VERIFY, "real_scale_stamp.files", str),
    ),
    F(
        B,
        "`full` is projected at {}",
        (VERIFY, "projection_450gb.full_ssd_bound_s", lambda x: f"{x} s"),
    ),
]


# docs/operator.md: metrics on/off decode, and the pipeline's ETA on the rehearsal preset
OVERHEAD = "benchmarks/results/2026-12-06/metrics-overhead.json"
ETA = "benchmarks/results/2026-12-06/pipeline-eta.json"
OP = ("docs/operator.md",)


def signed_pct(x: float) -> str:
    return f"{100 * x:+.0f} %"


FIGURES += [
    F(
        OP,
        "ratio of the\npaired rounds: median {}, p10 {}, p90 {}; median decode {} on,\n{} off",
        *(
            (OVERHEAD, f"paired_on_over_off_stats.{k}", "{:.3f}".format)
            for k in ("median", "p10", "p90")
        ),
        *(
            (OVERHEAD, f"decode_tok_s_stats.{k}.median", "{:.1f} tok/s".format)
            for k in ("metrics_on", "metrics_off")
        ),
    ),
    F(
        OP,
        "{} rounds, 1-minute\nload {} to {}",
        (OVERHEAD, "rounds", str),
        (OVERHEAD, "loadavg_1m_per_round", lambda xs: f"{min(xs):.1f}"),
        (OVERHEAD, "loadavg_1m_per_round", lambda xs: f"{max(xs):.1f}"),
    ),
    F(
        OP,
        "CPU seconds per token, on over off: median {} (p10 {},\np90 {})",
        *(
            (OVERHEAD, f"paired_cpu_on_over_off_stats.{k}", "{:.3f}".format)
            for k in ("median", "p10", "p90")
        ),
    ),
    F(
        OP,
        "(median {} in the rounds where the metrics server went first, {} where it went\nsecond)",
        (OVERHEAD, "paired_on_first.median", "{:.3f}".format),
        (OVERHEAD, "paired_off_first.median", "{:.3f}".format),
    ),
    *(
        F(
            OP,
            "| {} | {} | {} | {} | {} | {} | {} |",
            (ETA, f"stages.{i}.stage", str),
            (ETA, f"stages.{i}.seconds", lambda x: f"{x:.0f} s"),
            (ETA, f"stages.{i}.model_eta_before_start_s", lambda x: f"{x:.0f} s"),
            (ETA, f"stages.{i}.estimate_at_10pct_s", lambda x: f"{x:.0f} s"),
            (ETA, f"stages.{i}.at_10pct.eta_source", str),
            (ETA, f"stages.{i}.error_at_10pct", signed_pct),
            (ETA, f"stages.{i}.loadavg_1m.median", "{:.0f}".format),
        )
        for i in range(4)
    ),
]


def render(template: str, sources) -> str:
    vals = []
    for s in sources:
        if callable(s[0]):
            vals.append(s[1](s[0]()))
        else:
            path, key, fmt = s
            vals.append(fmt(_at(_json(path), key)))
    return template.format(*vals)


def _flat(text: str) -> str:
    """Line breaks as spaces: a figure may wrap."""
    return re.sub(r"\s*\n\s*", " ", text)


@pytest.mark.parametrize("figure", FIGURES, ids=lambda f: f[1][:40])
def test_figure_is_its_source(figure):
    docs, template, sources = figure
    want = _flat(render(template, sources))
    for d in docs:
        text = (REPO / d).read_text()
        if d.endswith(".yaml"):
            text = re.sub(r"(?m)^#\s?", "", text)  # a figure in comments may wrap
        assert want in _flat(text), (
            f"{d}: expected {want!r} (from {[s[:2] for s in sources if not callable(s[0])]}); "
            "the source moved: update the page (or regenerate the results file)"
        )


# Numbers with a unit (or a token count) in the pages the guide owns that are not measured
# or planned: what they are. Each page's other such numbers are FIGURES.
CONSTANTS = {
    "README.md": {
        "512 GB": "the Mac's memory (Apple's specification)",
        "256 GB": "a smaller Mac's memory (Apple's specification)",
    },
    "docs/agents.md": {
        "every 0.25 s": "k3dist/serve/server.py's poll of an idle stream (code)",
        "every 10 s": "the prefill progress line's period (code)",
        "180 s": "Claude Code's byte watchdog, first party (its code)",
        "else 300 s": "Claude Code's byte watchdog otherwise (its code)",
        "| 300 s (at least 300 s, at most 1,800 s)": "Claude Code's stream watchdog (its code)",
        "| 600 s |": "Claude Code's SDK time-out (its code)",
        "1 s later": "Claude Code's retry delay (its code)",
        "300,000 ms": "Codex's stream idle default (its config docs)",
        "600 s (`aider/models.py`": "aider's request time-out (its code)",
        "0.125 s doubling to 60 s": "aider's back-off (its code)",
        "`API_TIMEOUT_MS`'s 600 s": "Claude Code's SDK time-out (its code)",
        "sleeps 3 s": "tests/scripts/serve_paused.py's pause in the test",
        "a 2 s read time-out": "the test's client time-out",
        "the first 3 s pause": "the same pause",
        "~1,500-token completion": "the test's prompt length",
        "576 of 1505 prompt tokens": "an example log line (a run of test_server_abandon.py)",
    },
    "docs/serving.md": {
        "~30 s": "MLX's ring connect time-out (MLX's code)",
        "(30 minutes)": "the recipes' time-out settings, 1800000 ms",
    },
}
UNIT = re.compile(
    r"(?<![\w.])~?\d[\d,.]*\s?(?:TB|GB|GiB|MB|kB|tok/s|min|ms|h|s|%|(?:-token|\s(?:prompt\s)?tokens))(?![\w/])"
)


@pytest.mark.parametrize("page", sorted(CONSTANTS))
def test_every_number_has_a_source(page: str):
    """In README.md and the guide's docs pages, every number with a unit is a FIGURE
    (rendered from its source) or a stated constant; markers (HTML comments) aside."""
    text = _flat(re.sub(r"<!--.*?-->", "", (REPO / page).read_text()))
    covered = []
    for docs, template, sources in FIGURES:
        if page in docs:
            fig = _flat(render(template, sources))
            covered += [(m.start(), m.end()) for m in re.finditer(re.escape(fig), text)]
    for c in CONSTANTS[page]:
        covered += [(m.start(), m.end()) for m in re.finditer(re.escape(_flat(c)), text)]
    loose = [
        m.group(0)
        for m in UNIT.finditer(text)
        if not any(a <= m.start() and m.end() <= b for a, b in covered)
    ]
    assert not loose, f"{page}: figures without a source in FIGURES or CONSTANTS: {loose}"


def test_disk_plan_file_is_what_the_code_plans():
    """The committed plan is what the planner and the pipeline make now: a change to
    either fails here until `python benchmarks/pipeline/disk_plan.py --out FILE` is run again and
    the figures above follow."""
    sys.path.insert(0, str(REPO / "benchmarks" / "pipeline"))
    try:
        import disk_plan
    finally:
        sys.path.remove(str(REPO / "benchmarks" / "pipeline"))
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        now = disk_plan.plans()
    committed = _json(DISK)
    for key in ("disk_plan", "disk_plan_dwq"):
        assert committed[key] == now[key], key
    for key in ("lo", "promoted_total", "promoted_fraction", "expert_bpw", "bytes_per_rank"):
        assert committed["plan"][key] == now["plan"][key], key
    # the decode projection was made from this plan
    plan_file = re.search(r"--plan (\S+)", _json(PROJECT)["command"]).group(1)
    used = _json(plan_file)
    for key in ("lo", "promoted_total", "expert_bpw", "bytes_per_rank"):
        assert used[key] == now["plan"][key], f"{PROJECT} projects another plan ({key})"
    # and so was the calibrated table README quotes
    built = _json(SPEED)["build"]
    assert built["lo"] == now["plan"]["lo"]["format"], f"{SPEED} projects another lo bank"
    assert abs(built["expert_bpw"] - now["plan"]["expert_bpw"]) < 1e-3, SPEED


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def test_anchors_resolve():
    missing = []
    for p in DOCS:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", p.read_text()):
            f = (p.parent / target).resolve() if target else p
            if not f.exists() or f.suffix != ".md":
                continue  # a pending page (test_links_resolve) or not markdown
            slugs = {_slug(h) for h in re.findall(r"^#+ (.*)$", f.read_text(), re.M)}
            if anchor not in slugs:
                missing.append(f"{p.relative_to(REPO)} -> {target}#{anchor}")
    assert not missing, missing


def test_agent_recipes_are_complete():
    """docs/serving.md's recipes carry what each client needs (tests/serve/test_agent_clients.py
    runs each as printed): the key's variable set, the context flag, aider's settings file."""
    text = (REPO / "docs" / "serving.md").read_text()
    section = text.split("## Coding agents", 1)[1].split("\n## ", 1)[0]
    got = {b.body for b in blocks(REPO / "docs" / "serving.md") if b.body in section}
    claude = next(b for b in got if "claude " in b)
    codex = next(b for b in got if "codex " in b)
    aider = next(b for b in got if "aider " in b)
    for b in (claude, codex, aider):
        assert re.search(r"export K3=\S+ K3_KEY=", b), "each recipe sets the server and key"
    assert "ANTHROPIC_BASE_URL=$K3 " in claude and "ANTHROPIC_API_KEY=$K3_KEY" in claude
    assert 'env_key=\\"K3_KEY\\"' in codex and 'wire_api=\\"responses\\"' in codex
    assert "OPENAI_API_BASE=$K3/v1" in aider and "--model-metadata-file models.json" in aider
    # Claude Code's prompt needs the context the recipe's server command gives
    need = _json(AGENTS)["clients"]["claude"]
    ctx = int(re.search(r"--max-context (\d+)", section).group(1))
    assert need["count_tokens"] + need["max_tokens_sent"] <= ctx
    assert ctx == int(_json(AGENTS)["serve_args"][1])


def test_layout_page_says_what_each_layer_imports():
    """docs/layout.md's "Imports ..." line of each subpackage is its real imports."""
    import ast

    text = _flat((REPO / "docs" / "layout.md").read_text())
    packages = sorted(p.name for p in (REPO / "k3dist").iterdir() if (p / "__init__.py").exists())
    for pkg in packages:
        m = re.search(rf"- `k3dist/{pkg}/` — (.*?)(?= - `k3dist/|`launch/`|$)", text)
        assert m, f"docs/layout.md: no bullet for k3dist/{pkg}/"
        said = m.group(1)
        if "May import every layer" in said:
            continue
        stated = (
            set(re.findall(r"`(\w+)`", said.split("Imports", 1)[1])) if "Imports" in said else None
        )
        assert stated is not None, f"docs/layout.md: k3dist/{pkg}/ says nothing of its imports"
        if "Imports nothing else" in said:
            stated = set()
        real = set()
        for f in (REPO / "k3dist" / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                for n in names:
                    parts = n.split(".")
                    if parts[0] == "k3dist" and len(parts) > 1 and parts[1] in packages:
                        real.add(parts[1])
        real.discard(pkg)
        assert stated == real, f"docs/layout.md: k3dist/{pkg}/ imports {sorted(real)}"


def test_one_interpreter_convention():
    """Commands name the venv's tools (`.venv/bin/k3dist-*`, `.venv/bin/python`), never a
    bare `python`, `pip` or `mlx.launch` that may be another installation's."""
    bare = re.compile(r"(?<![\w/.-])(python3?|pip3?|mlx\.launch)(?= )")
    found = []
    for p in DOCS:
        text = p.read_text()
        code = [b.body for b in blocks(p) if b.lang in COMMAND_LANGS]
        # inline code opening with "[" is a quoted log line ("[k3dist rank R] ..."), not a command
        code += [c for c in re.findall(r"`([^`\n]+)`", FENCE.sub("", text)) if c[0] != "["]
        found += [f"{p.relative_to(REPO)}: {c}" for c in code if bare.search(c)]
    assert not found, found
