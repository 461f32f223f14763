"""Readers of the macOS commands k3dist-doctor runs on each Mac: plain functions from a
command's output to the fact the doctor checks, None (or empty) when the output does
not say. Tested against outputs recorded on Macs and published by others
(tests/serve/macos_outputs/sources.json names each one's source)."""

from __future__ import annotations

import json
import re


def parse_sw_vers(text: str) -> tuple[int, ...] | None:
    """``sw_vers`` (or ``sw_vers -productVersion``) -> (26, 2)."""
    m = re.search(r"(?:ProductVersion:\s*)?(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(x) for x in m.groups() if x is not None) if m else None


def parse_sysctl_int(text: str) -> int | None:
    """``sysctl -n NAME`` ('0') or ``sysctl NAME`` ('NAME: 0') -> 0; None if neither."""
    m = re.fullmatch(r"\s*(?:[\w.]+:\s*)?(-?\d+)\s*", text or "")
    return int(m[1]) if m else None


def parse_pmset(text: str) -> dict:
    """``pmset -g``: the idle ``sleep`` minutes in use (0: never) and ``SleepDisabled``
    (``pmset -a disablesleep 1``, listed under the system-wide settings), which keeps a
    Mac awake whatever ``sleep`` says."""
    sleep = re.search(r"^\s*sleep\s+(\d+)", text, re.M)
    disabled = re.search(r"^\s*SleepDisabled\s+(\d+)", text, re.M)
    return {
        "sleep": int(sleep[1]) if sleep else None,
        "sleep_disabled": bool(disabled and int(disabled[1])),
    }


def never_sleeps(text: str) -> bool:
    p = parse_pmset(text)
    return p["sleep_disabled"] or p["sleep"] == 0


def parse_vm_stat(text: str) -> int | None:
    """``vm_stat``: bytes free + inactive + speculative (what macOS can hand out)."""
    m = re.search(r"page size of (\d+) bytes", text)
    if not m:
        return None
    pages = 0
    for key in ("Pages free", "Pages inactive", "Pages speculative"):
        k = re.search(rf"^{key}:\s+(\d+)", text, re.M)
        pages += int(k[1]) if k else 0
    return pages * int(m[1])


def parse_thunderbolt(text: str) -> list[dict]:
    """``system_profiler -json SPThunderboltDataType``: per bus, its receptacle's link
    speed (``current_speed_key``: 'Up to 120 Gb/s' idle, '80 Gb/s' linked) and whether
    another Mac is on it (an item with a ``domain_uuid_key``: a drive or a dock has
    none, mlx's ``extract_connectivity`` rule)."""
    ports = []
    for bus in json.loads(text).get("SPThunderboltDataType", []):
        rec = bus.get("receptacle_1_tag") or {}
        peers = [i for i in bus.get("_items", []) if "domain_uuid_key" in i]
        ports.append(
            {
                "name": bus.get("_name", ""),
                "speed": rec.get("current_speed_key", ""),
                "connected": bool(peers),
            }
        )
    return ports


def tb_generation(speed: str) -> int | None:
    """'80 Gb/s' or 'Up to 120 Gb/s' -> 5, '40 Gb/s' -> 4."""
    m = re.search(r"(\d+)\s*Gb/s", speed)
    if not m:
        return None
    return 5 if int(m[1]) >= 80 else 4 if int(m[1]) >= 40 else 3


def parse_ibv_devices(text: str) -> list[str]:
    """``ibv_devices``: the device names (mlx's own rule: names starting rdma_). A Mac
    lists one per Thunderbolt port, cabled or not; none while RDMA is disabled."""
    return [w for w in text.split() if w.startswith("rdma_")]


def parse_ibv_devinfo(text: str) -> dict[str, str]:
    """``ibv_devinfo``: each device's port state ('PORT_ACTIVE' only where a cable is
    linked; an active port wins on a device with several)."""
    states: dict[str, str] = {}
    dev = None
    for line in text.splitlines():
        if m := re.match(r"\s*hca_id:\s*(\S+)", line):
            dev = m[1]
        elif (m := re.match(r"\s*state:\s*(PORT_\w+)", line)) and dev:
            if states.get(dev) != "PORT_ACTIVE":
                states[dev] = m[1]
    return states


def parse_rdma_ctl(text: str) -> str | None:
    """``rdma_ctl status``: 'enabled' or 'disabled' (anything else, e.g. its 'needs to
    be executed from Recovery OS' message, is None)."""
    word = (text or "").strip().lower()
    return word if word in ("enabled", "disabled") else None
