"""The deployment: one typed definition of every key makes the flags of launch/serve.py,
launch/generate.py and slicing/rank_split.py; bad values from a YAML or a flag are
refused naming the file or flag, the key, what is allowed and the fix."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

from k3dist.config import deployment
from k3dist.config.deployment import Deployment, DeploymentError, load_deployment

import pytest
from util import REPO

SCRIPTS = {
    "serve": REPO / "launch" / "serve.py",
    "generate": REPO / "launch" / "generate.py",
    "rank_split": REPO / "slicing" / "rank_split.py",
}
# the flags each script had before they were generated: names and meanings kept
BEFORE = {
    "serve": {
        "--config",
        "--rank-dir",
        "--host",
        "--port",
        "--model-id",
        "--max-context",
        "--prefill-chunk",
        "--max-tokens",
        "--temperature",
        "--top-p",
        "--token-log",
        "--moe-form",
        "--attention",
        "--dtype",
        "--blas-threads",
        "--heartbeat-s",
        "--watchdog-timeout-s",
        "--watchdog-port",
        "--memory-headroom-gib",
        "--max-queued-requests",
        "--max-connections",
        "--max-batch",
        "--max-images",
        "--max-image-pixels",
        "--image-dir",
        "--api-key",
        "--api-key-file",
        "--prompt-cache-tokens",
        "--prefix-cache-dir",
        "--prefix-cache-gb",
        "--prefix-cache-min-tokens",
        "--prefix-cache-preload-gb",
        "--prefix-cache-drain-s",
        "--verify",
        "--cors-origin",
        "--no-warmup",
        "--allow-no-api-key",
        "--vision",
    },
    "generate": {
        "--config",
        "--rank-dir",
        "--dtype",
        "--moe-form",
        "--attention",
        "--count",
        "--blas-threads",
        "--verify",
        "--prompt-ids",
        "--prompt-random",
        "--seed",
        "--max-tokens",
        "--dump",
    },
    "rank_split": {
        "--rank",
        "--all",
        "--size",
        "--build",
        "--out",
        "--placement-counts",
        "--attention",
        "--config",
    },
}


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "100000"}  # argparse wraps --help at the terminal width
    return subprocess.run(
        [sys.executable, str(SCRIPTS[script]), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    out = {}
    for name in SCRIPTS:
        r = _run(name, "--help")
        assert r.returncode == 0, r.stderr
        out[name] = r.stdout
    return out


def test_every_key_is_a_flag_with_its_help(helps):
    flags = {
        name: set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)) for name, text in helps.items()
    }
    for name, before in BEFORE.items():
        assert before <= flags[name], (name, sorted(before - flags[name]))
    alias = {"rank_split": {"rank_dir": "--out"}}
    own = {"generate": {"--max-tokens"}}  # a script's own flag (greedy steps), not the key's
    seen = set()
    for key, field in Deployment.model_fields.items():
        for name, text in helps.items():
            flag = alias.get(name, {}).get(key, deployment.flag(key))
            if flag in flags[name] - own.get(name, set()):
                seen.add(key)
                assert " ".join(field.description.split()) in " ".join(text.split()), (name, key)
    assert seen == set(Deployment.model_fields), sorted(set(Deployment.model_fields) - seen)


def _parse(argv: list[str], keys=None) -> Deployment:
    ap = argparse.ArgumentParser()
    deployment.add_arguments(ap, keys)
    return deployment.from_args(ap, ap.parse_args(argv), keys)


def test_flags_override_the_yaml(tmp_path):
    y = tmp_path / "d.yaml"
    y.write_text("max_batch: 3\nport: 9001\nvision: true\nwarmup: false\ncors_origins: [a]\n")
    d = _parse(["--config", str(y)])
    assert (d.max_batch, d.port, d.vision, d.warmup, d.cors_origins) == (
        3,
        9001,
        True,
        False,
        ["a"],
    )
    assert d.max_context == Deployment().max_context  # neither: the definition's default
    d = _parse(
        [
            "--config",
            str(y),
            "--max-batch",
            "5",
            "--no-vision",
            "--warmup",
            "--cors-origin",
            "x",
            "--cors-origin",
            "y",
        ]
    )
    assert (d.max_batch, d.port, d.vision, d.warmup, d.cors_origins) == (
        5,
        9001,
        False,
        True,
        ["x", "y"],
    )
    assert _parse(["--config", str(y), "--no-warmup"]).warmup is False
    # a script's subset: only its keys are flags
    with pytest.raises(SystemExit):
        _parse(["--port", "1"], keys=deployment.keys("rank"))


def test_a_bad_yaml_value_names_the_file_key_range_and_fix(tmp_path):
    y = tmp_path / "bad.yaml"
    y.write_text("max_batch: 1000\n")
    with pytest.raises(DeploymentError) as e:
        load_deployment(y)
    msg = str(e.value)
    assert f"{y}: max_batch must be an integer at least 1 and at most 256, not 1000" in msg
    assert f"set max_batch in {y} to such a value, or give --max-batch" in msg
    y.write_text("attention: tensor\n")
    with pytest.raises(
        DeploymentError, match=f"{y}: attention must be split or replicated, not 'tensor'"
    ):
        load_deployment(y)
    y.write_text("max_bach: 4\n")
    with pytest.raises(
        DeploymentError,
        match=r"unknown setting 'max_bach' \(did you mean "
        r"'max_batch'\?\)",
    ):
        load_deployment(y)
    y.write_text("prefill_chunk: 100\n")
    with pytest.raises(
        DeploymentError,
        match=r"prefill_chunk .*not 100 \(must be a power "
        r"of two \(e.g. 64 or 128\)\)",
    ):
        load_deployment(y)
    y.write_text("api_key: abcdefgh\napi_key_file: k\n")
    with pytest.raises(DeploymentError, match="give api_key or api_key_file, not both"):
        load_deployment(y)
    y.write_text("- max_batch\n")
    with pytest.raises(DeploymentError, match="expected a mapping of settings"):
        load_deployment(y)
    # the shipped deployments are valid
    for name in ("local.yaml", "tb5.yaml"):
        load_deployment(REPO / "deploy" / name)


def test_a_bad_flag_names_the_flag_key_and_range(tmp_path):
    with pytest.raises(
        DeploymentError,
        match=r"--top-p 1.5: top_p must be a number more "
        r"than 0 and at most 1, not 1.5; give --top-p such a value",
    ):
        load_deployment(None, top_p=1.5)
    # the scripts end with the parser's error (exit 2) before any rank starts
    r = _run("serve", "--max-batch", "0")
    assert r.returncode == 2, r.stderr
    assert "--max-batch 0: max_batch must be an integer at least 1 and at most 256" in r.stderr
    r = _run("generate", "--dtype", "int8")
    assert r.returncode == 2 and "invalid choice: 'int8'" in r.stderr, r.stderr
    (tmp_path / "d.yaml").write_text("size: 0\n")
    r = _run("rank_split", "--all", "--config", str(tmp_path / "d.yaml"))
    assert r.returncode == 2, r.stderr
    assert f"{tmp_path / 'd.yaml'}: size must be an integer at least 1, not 0" in r.stderr
    r = _run("rank_split", "--all", "--config", str(tmp_path / "none.yaml"))
    assert r.returncode == 2 and "none.yaml does not exist" in r.stderr, r.stderr


def test_a_renamed_key_is_read_with_a_notice(tmp_path, capsys):
    """memory_headroom_gb (GiB all along) is now memory_headroom_gib: the old name still
    works, in a YAML and as a flag, and says what to rename."""
    old = tmp_path / "old.yaml"
    old.write_text("memory_headroom_gb: 7\n")
    assert load_deployment(old).memory_headroom_gib == 7
    assert "memory_headroom_gb is deprecated, it is now memory_headroom_gib" in (
        capsys.readouterr().err
    )
    ap = argparse.ArgumentParser()
    deployment.add_arguments(ap)
    dep = deployment.from_args(ap, ap.parse_args(["--memory-headroom-gb", "9"]))
    assert dep.memory_headroom_gib == 9
    assert "memory_headroom_gb is deprecated" in capsys.readouterr().err


def test_boxes_with_memory_and_wired_limit(tmp_path):
    """`boxes` lists each box's memory and, optionally, its wired limit: mappings in a
    YAML, `GiB[:wired_limit_mb]` in a flag or a string; size follows; a wired limit
    above the memory is refused with the numbers."""
    want = [(512.0, 499712), (256.0, 237568), (256.0, None)]
    y = tmp_path / "d.yaml"
    y.write_text(
        "boxes:\n  - {memory_gib: 512, wired_limit_mb: 499712}\n"
        "  - {memory_gib: 256, wired_limit_mb: 237568}\n  - 256\n"
    )
    for dep in (
        load_deployment(y),
        load_deployment(None, boxes=["512:499712,256:237568", "256"]),
        _parse(["--boxes", "512:499712,256:237568,256"], ("size", "boxes")),
    ):
        assert [(b.memory_gib, b.wired_limit_mb) for b in dep.boxes] == want
        assert dep.size == 3 and dep.box_gib == [512.0, 256.0, 256.0]
        assert [b.wired_limit_mb for b in dep.box_list()] == [499712, 237568, 237568]
    assert load_deployment(None, boxes="512,256,256").box_gib == [512.0, 256.0, 256.0]
    y.write_text("boxes:\n  - {memory_gib: 256, wired_limit_mb: 300000}\n")
    with pytest.raises(DeploymentError, match=r"300000 is more than the box's 256 GiB \(262144"):
        load_deployment(y)
    y.write_text("boxes:\n  - {memory_gib: 256, wired: 1}\n")
    with pytest.raises(DeploymentError, match="wired"):
        load_deployment(y)
    for name in ("tb5-3", "tb5-4"):
        dep = load_deployment(REPO / "deploy" / f"{name}.yaml")
        assert dep.size == int(name[-1]) and all(b.wired_limit_mb for b in dep.boxes)
