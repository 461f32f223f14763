"""Two Macs, emulated for real: two network namespaces joined by a veth "cable", a real
sshd in each, keys and an ssh config made here, and a hostfile naming both hosts.

    sudo .venv/bin/python tests/rig.py up      # prints the PATH line that makes `ssh k3h-mac2` work
    .venv/bin/python tests/rig.py down

Both hosts see this machine's filesystem (as two Macs with the checkout and venv at the
same path do); only their network is their own: ``k3h-mac1`` has 10.77.0.1/24 and
``k3h-mac2`` 10.77.0.2/24 on the two ends of the veth pair, each with its loopback up,
and nothing is routed outside them; each host's sessions have their own HOME
(``Rig.home``). Run a command "on mac1" with ``rig.on(1, [...])``
(``ip netns exec k3h-mac1 ...``). ``ssh`` resolves the host names through ``bin/ssh`` in
the rig's folder (``ssh -F <rig>/ssh_config``), first on PATH: mlx.launch and k3dist's
supervisor start plain ``ssh``, as on a Mac whose ~/.ssh/config names the other.

Faults the rig can make: the cable down/up (``ip link set``), packet loss (nftables
``numgen random mod 100 < N drop`` on mac2's end), a host's sshd stopped, a host's
processes killed, a host's wall clock moved (``skewed_clock``: libfaketime preloaded into
that host's ssh sessions; the namespaces share the kernel's clock, so it is moved for
what the host's sessions run, not for the kernel). It cannot delay packets: this kernel
has no netem (CONFIG_NET_SCH_NETEM is not set).

One rig at a time on a machine (the names are fixed): ``up`` takes an flock on
/tmp/k3h-rig.lock and ``down`` (also the fixture's teardown, also after a failure)
removes the namespaces, the sshd processes and the folder.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOSTS = ("k3h-mac1", "k3h-mac2")
ADDRS = ("10.77.0.1", "10.77.0.2")
CABLE = ("k3h-cable0", "k3h-cable1")  # mac1's end, mac2's end
NFT_TABLE = "k3h_loss"
NFT_BLOCK = "k3h_block"
LOCK = Path("/tmp/k3h-rig.lock")
STATE = Path("/tmp/k3h-rig.json")  # where `up` left its folder (for `down`)


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30)


def faketime_lib() -> str | None:
    """Debian's libfaketime (package ``libfaketime``), or None."""
    found = sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))
    return str(found[0]) if found else None


def skewed_clock(offset_s: int) -> dict[str, str]:
    """The environment that moves a host's wall clock by ``offset_s`` for its ssh
    sessions (``Rig.set_env``): libfaketime preloaded into the session's shell and
    everything it starts (``date``, python's ``time.time()``), not into sshd, so the
    handshake is untouched. Only CLOCK_REALTIME moves, as on a Mac whose clock is off:
    the monotonic clocks (the watchdog's) and file times (the rank folders' stamps) stay."""
    lib = faketime_lib()
    if lib is None:
        raise RuntimeError("libfaketime is missing: apt-get install -y libfaketime (scripts/setup)")
    return {
        "LD_PRELOAD": lib,
        "FAKETIME": f"{offset_s:+d}s",
        "DONT_FAKE_MONOTONIC": "1",
        "NO_FAKE_STAT": "1",
    }


def tools_missing() -> str | None:
    """Why a rig cannot be made here, or None."""
    if os.geteuid() != 0:
        return "the rig needs root (network namespaces)"
    for tool, pkg in (("/usr/sbin/sshd", "openssh-server"), ("ip", "iproute2")):
        if not shutil.which(tool):
            return f"{tool} is missing: apt-get install -y {pkg}"
    return None


class Rig:
    """The two hosts. ``Rig.up()`` makes them; ``down()`` removes everything it made."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sshd: list[subprocess.Popen] = []
        self._lock_fd: int | None = None

    # ---------------------------------------------------------------- names

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def hostfile(self) -> Path:
        return self.root / "hostfile.json"

    def env(self, base: dict | None = None) -> dict:
        """An environment whose ``ssh`` knows the rig's hosts."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.bin}:{env.get('PATH', '/usr/bin:/bin')}"
        return env

    def home(self, host: int) -> Path:
        """Each host's home folder (its sessions' HOME): what is in ~ is one Mac's own
        (an API key file on mac1 only), while the rest of the filesystem is shared."""
        return self.root / f"home-{HOSTS[host - 1]}"

    @staticmethod
    def netns(host: int) -> list[str]:
        """Prefix that runs a command on mac``host`` (1 or 2)."""
        return ["ip", "netns", "exec", HOSTS[host - 1]]

    def on(self, host: int, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("timeout", 60)
        kw.setdefault("env", self.env())
        return subprocess.run([*self.netns(host), *cmd], **kw)

    def set_env(self, host: int, env: dict[str, str]) -> None:
        """The environment of mac``host``'s ssh sessions beyond its own HOME (as a Mac's
        shell profile sets it); takes effect on the next session."""
        keys = self.root / "keys"
        opts = ",".join(
            f'environment="{k}={v}"' for k, v in {"HOME": self.home(host), **env}.items()
        )
        (keys / f"authorized_keys_{HOSTS[host - 1]}").write_text(
            f"{opts} " + (keys / "client.pub").read_text()
        )

    # ---------------------------------------------------------------- faults

    def block_ports(self, host: int, low: int | None, high: int | None = None) -> None:
        """Drop TCP to ports low..high on mac``host`` (a firewall); None: unblock."""
        ns = self.netns(host)
        _sh(*ns, "nft", "delete", "table", "inet", NFT_BLOCK, check=False)
        if low is None:
            return
        rules = (
            f"table inet {NFT_BLOCK} {{\n  chain in {{ type filter hook input priority 0; "
            f"tcp dport {low}-{high or low} drop; }}\n}}\n"
        )
        subprocess.run([*ns, "nft", "-f", "-"], input=rules, text=True, check=True, timeout=30)

    def cable(self, up: bool) -> None:
        """Plug or pull the cable (both ends, as a pulled cable drops both links)."""
        for i, dev in enumerate(CABLE):
            _sh(*self.netns(i + 1), "ip", "link", "set", dev, "up" if up else "down")

    def loss(self, percent: int | None) -> None:
        """Drop ``percent`` % of the packets mac2 receives and sends (None: none)."""
        ns = self.netns(2)
        _sh(*ns, "nft", "delete", "table", "inet", NFT_TABLE, check=False)
        if not percent:
            return
        rules = (
            f"table inet {NFT_TABLE} {{\n"
            f"  chain in {{ type filter hook input priority 0; "
            f"numgen random mod 100 < {percent} drop; }}\n"
            f"  chain out {{ type filter hook output priority 0; "
            f"numgen random mod 100 < {percent} drop; }}\n"
            "}\n"
        )
        subprocess.run([*ns, "nft", "-f", "-"], input=rules, text=True, check=True, timeout=30)

    def stop_sshd(self, host: int) -> None:
        p = self.sshd[host - 1]
        if p.poll() is None:
            p.terminate()
            p.wait(10)

    def start_sshd(self, host: int) -> None:
        if self.sshd[host - 1].poll() is None:
            return
        self.sshd[host - 1] = self._sshd(host)

    def in_hosts(self, cmd: list[str], check: bool = True) -> None:
        """``cmd`` in each host's mount namespace (its sshd's: what an ssh session to that
        host sees), e.g. a small tmpfs mounted where a host writes."""
        for p in self.sshd:
            subprocess.run(["nsenter", "-t", str(p.pid), "-m", *cmd], check=check, timeout=30)

    # ---------------------------------------------------------------- life

    @classmethod
    def up(cls, root: Path | None = None) -> Rig:
        why = tools_missing()
        if why:
            raise RuntimeError(why)
        fd = os.open(LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(
                f"another rig is up on this machine ({LOCK} is locked): "
                "`python tests/rig.py down` or wait for its test"
            ) from None
        rig = cls(Path(root or tempfile.mkdtemp(prefix="k3h-rig-")))
        rig._lock_fd = fd
        try:
            rig._make()
        except BaseException:
            rig.down()
            raise
        return rig

    def _make(self) -> None:
        if STATE.exists():
            old = json.loads(STATE.read_text())
            if old.get("pid") is None or _alive(old["pid"]):
                raise RuntimeError(f"a rig is up ({old['root']}): `python tests/rig.py down` first")
            shutil.rmtree(old["root"], ignore_errors=True)  # left by a killed run
        _remove_network()
        self.root.mkdir(parents=True, exist_ok=True)
        STATE.write_text(json.dumps({"root": str(self.root), "pid": os.getpid()}))
        for ns in HOSTS:
            _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", CABLE[0], "type", "veth", "peer", "name", CABLE[1])
        for i, (ns, dev, addr) in enumerate(zip(HOSTS, CABLE, ADDRS, strict=True)):
            _sh("ip", "link", "set", dev, "netns", ns)
            n = self.netns(i + 1)
            _sh(*n, "ip", "link", "set", "lo", "up")
            _sh(*n, "ip", "addr", "add", f"{addr}/24", "dev", dev)
            _sh(*n, "ip", "link", "set", dev, "up")
        # keys: one host key a host, one client key, known_hosts naming both
        keys = self.root / "keys"
        keys.mkdir()
        for host in (1, 2):
            self.home(host).mkdir(parents=True)
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / "client"))
        known = []
        for ns, addr in zip(HOSTS, ADDRS, strict=True):
            _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / ns))
            pub = (keys / f"{ns}.pub").read_text().split()
            known.append(f"{ns},{addr} {pub[0]} {pub[1]}")
        (keys / "known_hosts").write_text("\n".join(known) + "\n")
        for host in (1, 2):  # each host's sessions get its own HOME
            self.set_env(host, {})
        cfg = [
            f"Host {ns} {addr}\n  HostName {addr}\n  User root\n  IdentityFile {keys / 'client'}\n"
            f"  IdentitiesOnly yes\n  UserKnownHostsFile {keys / 'known_hosts'}\n"
            "  StrictHostKeyChecking yes\n  PasswordAuthentication no\n"
            for i, (ns, addr) in enumerate(zip(HOSTS, ADDRS, strict=True))
        ]
        (self.root / "ssh_config").write_text("\n".join(cfg))
        self.bin.mkdir()
        ssh = self.bin / "ssh"
        ssh.write_text(
            "#!/bin/sh\n# the rig's hosts for any ssh started with this folder on PATH\n"
            f'exec /usr/bin/ssh -F {self.root / "ssh_config"} "$@"\n'
        )
        ssh.chmod(0o755)
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation folder
        self.sshd = [self._sshd(1), self._sshd(2)]
        self.hostfile.write_text(
            json.dumps(
                {
                    "backend": "ring",
                    "hosts": [
                        {"ssh": ns, "ips": [addr]} for ns, addr in zip(HOSTS, ADDRS, strict=True)
                    ],
                },
                indent=2,
            )
            + "\n"
        )
        self.wait_ssh()

    def _sshd(self, host: int) -> subprocess.Popen:
        ns, addr = HOSTS[host - 1], ADDRS[host - 1]
        keys = self.root / "keys"
        conf = self.root / f"sshd_{ns}.conf"
        conf.write_text(
            f"ListenAddress {addr}\nPort 22\nHostKey {keys / ns}\n"
            f"AuthorizedKeysFile {keys / f'authorized_keys_{ns}'}\n"
            f"PidFile {self.root / f'sshd_{ns}.pid'}\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            "PrintMotd no\nPrintLastLog no\nMaxStartups 64\nMaxSessions 64\n"
            "ClientAliveInterval 0\nPermitUserEnvironment yes\n"
        )
        log = open(self.root / f"sshd_{ns}.log", "ab")  # noqa: SIM115 - sshd holds it
        p = subprocess.Popen(
            [*self.netns(host), "/usr/sbin/sshd", "-D", "-e", "-f", str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        log.close()
        return p

    def wait_ssh(self, timeout_s: float = 20.0) -> None:
        """Each host answers ``ssh HOST true`` from the other (bounded)."""
        deadline = time.monotonic() + timeout_s
        for src, dst in ((1, 2), (2, 1), (1, 1)):
            while True:
                r = self.on(src, ["ssh", "-o", "ConnectTimeout=2", HOSTS[dst - 1], "true"])
                if r.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ssh {HOSTS[dst - 1]} from mac{src}: {r.stderr}")
                time.sleep(0.2)

    def down(self) -> None:
        for p in self.sshd:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.sshd:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        _remove_network()
        shutil.rmtree(self.root, ignore_errors=True)
        STATE.unlink(missing_ok=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _remove_network() -> None:
    """Every process still in the rig's namespaces (sessions, ranks), then the
    namespaces (which takes the veth pair and the nft table with them)."""
    for ns in HOSTS:
        r = _sh("ip", "netns", "pids", ns, check=False)
        for pid in r.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _sh("ip", "netns", "del", ns, check=False)
    _sh("ip", "link", "del", CABLE[0], check=False)


def main(argv: list[str]) -> int:
    if argv[:1] == ["up"]:
        rig = Rig.up()
        STATE.write_text(json.dumps({"root": str(rig.root), "pid": None}))  # until `down`
        print(f"rig up in {rig.root}\n  export PATH={rig.bin}:$PATH")
        print(f"  hostfile: {rig.hostfile}")
        print(f"  ssh {HOSTS[1]} hostname; ip netns exec {HOSTS[0]} bash")
        return 0
    if argv[:1] == ["down"]:
        root = json.loads(STATE.read_text())["root"] if STATE.exists() else None
        _remove_network()  # sshd and every session run in the namespaces: ended there
        if root:
            shutil.rmtree(root, ignore_errors=True)
        STATE.unlink(missing_ok=True)
        print("rig down")
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
