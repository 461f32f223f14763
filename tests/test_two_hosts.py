"""Two Macs, emulated for real (issue 39): two network namespaces with a real sshd each,
joined by a veth cable (tests/rig.py), and README's two-Mac steps on them
(tests/two_macs.py): rank 1's folder copied over the cable with rsync and verified on
mac2, the supervised launch through mlx.launch's real ``ssh -tt`` path, the server on
mac1's cable address with the key on mac1 only, the OpenAI and Anthropic clients from
both hosts. Then the cable is pulled mid-stream: the stream gets an error event, the
supervisor exits 3 naming mac2 within the watchdog's timeout + a few seconds, and a
restart after the cable returns serves again.

The launches run with --no-warmup to keep the suite's budget (warm-up's 40 s of JIT
compiles on a loaded 2-core machine changes nothing on this path; `python
tests/two_macs.py` runs the walkthrough with it).
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest
import rig as rigmod
import two_macs
from two_macs import PY, REPO, Served

# the deployment's watchdog_timeout_s in two_macs.make_site
WATCHDOG_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def rig():
    why = rigmod.tools_missing()
    if why:
        pytest.fail(f"the two-host rig cannot be made here: {why} (.ci/run installs it)")
    r = rigmod.Rig.up()
    try:
        yield r
    finally:
        r.down()


@pytest.fixture(scope="module")
def site(rig, mini_build):
    return two_macs.make_site(rig, mini_build, rig.root / "work")


def _stream_on_mac1(rig, max_tokens: int) -> subprocess.Popen:
    return subprocess.Popen(
        [
            *rig.netns(1),
            PY,
            str(REPO / "tests/scripts/rig_client.py"),
            f"http://{rigmod.ADDRS[0]}:{two_macs.API_PORT}",
            str(rig.home(1) / ".k3dist-key"),
            "--stream",
            str(max_tokens),
            "--timeout-s",
            "60",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=rig.env(),
    )


def test_two_macs_walkthrough_then_cable_pulled_mid_stream(rig, site):
    key = rig.home(1) / ".k3dist-key"
    assert not (rig.home(2) / ".k3dist-key").exists()  # the key is on mac1 only
    served = Served(rig, site, "--no-warmup")
    stream = None
    try:
        ready = served.wait_ready(180)
        for host in (1, 2):
            got = two_macs.client(rig, host, key)
            assert got["health"] == 200 and got["no_key"] == 401, got
            assert got["chat"]["completion_tokens"] > 0, got
            assert got["messages"]["output_tokens"] > 0, got
        # mlx.launch idle over ssh: it selected on its ssh clients' stdin pipes (a core)
        launcher = served.launcher_pid()
        assert launcher is not None
        c0 = two_macs.cpu_s(launcher)
        time.sleep(3.0)
        idle = two_macs.cpu_s(launcher) - c0
        assert idle < 0.3, f"mlx.launch used {idle:.2f} CPU-s in 3 s idle"

        # the cable pulled while a stream decodes
        stream = _stream_on_mac1(rig, 3000)
        assert stream.stdout.readline().strip() == "FIRST"
        t0 = time.monotonic()
        rig.cable(False)
        rc = served.wait_exit(WATCHDOG_TIMEOUT_S + 25)
        exit_s = time.monotonic() - t0
        out = served.output()
        got = json.loads(stream.communicate(timeout=30)[0].strip().splitlines()[-1])
    finally:
        rig.cable(True)
        served.stop()
        if stream is not None and stream.poll() is None:
            stream.kill()
    assert rc == 3, out
    assert "lost rank 1 on host k3h-mac2" in out, out
    assert got["end"] == "error event", got
    assert "rank 1 was lost" in json.dumps(got["error"]), got
    bound = WATCHDOG_TIMEOUT_S + 10
    assert exit_s < bound, f"exit {exit_s:.1f} s after the pull (bound {bound} s):\n{out}"
    print(
        f"\nready in {ready:.1f} s; mlx.launch idle {idle:.2f} CPU-s in 3 s; cable pulled: "
        f"exit 3 after {exit_s:.1f} s"
    )

    # the cable back: a restart serves again, from mac2 too, and stops cleanly
    rig.wait_ssh()
    again = Served(rig, site, "--no-warmup")
    try:
        again.wait_ready(180)
        got = two_macs.client(rig, 2, key)
        assert got["chat"]["completion_tokens"] > 0, got
    finally:
        again.stop()
    out = again.output()
    assert again.proc.returncode == 0, out
    assert two_macs.launch_files_left(out) == [], out
    left = [p for p in two_macs.rig_pids(2) if not two_macs.is_sshd(p)]
    assert left == [], left
