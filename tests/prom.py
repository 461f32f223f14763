"""A real Prometheus server for a test (Debian's ``prometheus``, installed by
scripts/setup): its own config and data folder under the test's tmp, listening on
127.0.0.1 only, scraping the given targets every second; queried through its HTTP API.
Stopped (and its process group ended) on leaving the ``with``, also on failure."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from util import free_base_port

EXE = "/usr/bin/prometheus"


class Prometheus:
    """``with Prometheus(tmp, "127.0.0.1:PORT") as p: p.query(...)``."""

    def __init__(self, tmp: Path, target: str, key: str | None = None, start_s: float = 60):
        self.tmp, self.target, self.key, self.start_s = Path(tmp), target, key, start_s
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> Prometheus:
        exe = EXE if os.access(EXE, os.X_OK) else shutil.which("prometheus")
        if exe is None:
            raise RuntimeError(
                "this test runs a Prometheus server: apt-get install -y --no-install-recommends "
                "prometheus (scripts/setup does)"
            )
        self.tmp.mkdir(parents=True, exist_ok=True)
        job = {
            "job_name": "k3dist",
            "metrics_path": "/metrics",
            "scrape_interval": "1s",
            "scrape_timeout": "1s",
            "static_configs": [{"targets": [self.target]}],
        }
        if self.key is not None:  # the API's key, as for a server off loopback
            (self.tmp / "key").write_text(self.key)
            job["authorization"] = {"credentials_file": str(self.tmp / "key")}
        # JSON is YAML: no YAML writer needed
        conf = self.tmp / "prometheus.yml"
        conf.write_text(json.dumps({"global": {"scrape_interval": "1s"}, "scrape_configs": [job]}))
        port = free_base_port(1)
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(self.tmp / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [
                exe,
                f"--config.file={conf}",
                f"--storage.tsdb.path={self.tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.time() + self.start_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}: {self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready in {self.start_s} s: {self.output()}")

    def output(self) -> str:
        return (self.tmp / "prometheus.log").read_text(errors="replace")[-3000:]

    def query(self, expr: str) -> list[dict]:
        """An instant query's result (a vector: [{"metric": {...}, "value": [t, "v"]}])."""
        q = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=10) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus query {expr!r}: {body}")
        return body["data"]["result"]

    def wait(self, expr: str, cond, timeout: float = 60.0) -> list[dict]:
        """``query(expr)`` until ``cond(result)`` holds or ``timeout`` passes (the last
        result is returned either way: the caller asserts)."""
        deadline = time.time() + timeout
        while True:
            res = self.query(expr)
            if cond(res) or time.time() > deadline:
                return res
            time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(15)
        if getattr(self, "log", None) is not None:
            self.log.close()
