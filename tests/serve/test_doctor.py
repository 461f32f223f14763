"""k3dist-doctor's macOS-only probes, parsed from command outputs recorded on Macs.

Nobody on this project has a Mac, so the outputs are others' published ones:
tests/serve/macos_outputs/ holds each as published and sources.json names where it came
from (an mlx issue, oMLX's recorded captures, other projects' threads, a blog post). No
citable recorded output was found of ``sw_vers`` on macOS 26, of a non-zero
``iogpu.wired_limit_mb``, of ``sysctl -n`` or of a Thunderbolt 4 Mac-to-Mac link in
``system_profiler -json``: those cases below are written in the documented form and
marked so (``DOCUMENTED_*``). The live checks run on the rig
(tests/serve/test_two_hosts.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from k3dist.serve import doctor, macos

REPO = Path(__file__).resolve().parents[2]
OUTPUTS = Path(__file__).parent / "macos_outputs"
SOURCES = json.loads((OUTPUTS / "sources.json").read_text())["files"]

# documented forms (no recorded output found; sources.json "not_found")
DOCUMENTED_SW_VERS = "ProductName:\t\tmacOS\nProductVersion:\t\t26.2\nBuildVersion:\t\t25C56\n"
DOCUMENTED_WIRED = ("0\n", "480000\n", "iogpu.wired_limit_mb: 480000\n")


def recorded(name: str) -> str:
    assert name in SOURCES, f"{name}: no source in macos_outputs/sources.json"
    return (OUTPUTS / name).read_text()


SW_VERS_OLD = "sw_vers-productVersion-10.13.6.txt"  # what the probe runs: sw_vers -productVersion
WIRED_DEFAULT = "sysctl-iogpu-wired_limit_mb-16gb.txt"  # what the probe runs: sysctl NAME


def tb4(text: str) -> str:
    """A recorded capture with its Mac-to-Mac link at 40 Gb/s (documented form)."""
    return text.replace('"current_speed_key" : "80 Gb/s"', '"current_speed_key" : "40 Gb/s"')


STUDIO_TB = "system_profiler-thunderbolt-mac-studio-m3-ultra.json"
MACBOOK_TB = "system_profiler-thunderbolt-macbook-pro-m5-max.json"


def test_every_recorded_output_has_a_source_and_is_read():
    on_disk = {p.name for p in OUTPUTS.iterdir() if p.name != "sources.json"}
    assert on_disk == set(SOURCES), on_disk ^ set(SOURCES)
    for name, src in SOURCES.items():
        assert src["source"].startswith("https://") and src["command"], name


def test_parsers_read_the_recorded_outputs():
    # Thunderbolt 5: the Studio's link to the MacBook is the one Mac peer (80 Gb/s);
    # its drive (also 80 Gb/s, no domain UUID) and idle ports ("Up to 120") are not
    studio = macos.parse_thunderbolt(recorded(STUDIO_TB))
    assert [p for p in studio if p["connected"]] == [
        {"name": "thunderboltusb4_bus_1", "speed": "80 Gb/s", "connected": True}
    ]
    assert len(studio) == 6
    macbook = macos.parse_thunderbolt(recorded(MACBOOK_TB))
    assert [p["speed"] for p in macbook if p["connected"]] == ["80 Gb/s"]
    assert macos.tb_generation("80 Gb/s") == macos.tb_generation("Up to 120 Gb/s") == 5
    assert macos.tb_generation("40 Gb/s") == 4
    # RDMA: one device per Thunderbolt port; only the cabled one's port is active
    assert macos.parse_ibv_devices(recorded("ibv_devices-mac-mini-m4-pro.txt")) == [
        "rdma_en2",
        "rdma_en3",
        "rdma_en4",
    ]
    omlx = recorded("ibv_devices-omlx-cluster.txt")
    assert macos.parse_ibv_devices(omlx) == ["rdma_en1", "rdma_en7"]
    assert macos.parse_ibv_devices(recorded("ibv_devices-rdma-disabled.txt")) == []
    assert macos.parse_ibv_devinfo(recorded("ibv_devinfo-omlx-cluster.txt")) == {
        "rdma_en1": "PORT_DOWN",
        "rdma_en7": "PORT_DOWN",
        "rdma_en2": "PORT_ACTIVE",
    }
    assert macos.parse_rdma_ctl(recorded("rdma_ctl-status-mac-mini-m4-pro.txt")) == "enabled"
    assert (
        macos.parse_rdma_ctl("rdma_ctl: This tool needs to be executed from Recovery OS.") is None
    )
    # pmset: "sleep 1 (sleep prevented by ...)" but SleepDisabled 1: this Mac never sleeps
    pm = recorded("pmset-g-macbook-pro-arm64.txt")
    assert macos.parse_pmset(pm) == {"sleep": 1, "sleep_disabled": True}
    assert macos.never_sleeps(pm)
    assert not macos.never_sleeps(pm.replace(" SleepDisabled\t\t1\n", ""))
    # vm_stat: free + inactive + speculative pages, at the page size it states
    assert macos.parse_vm_stat(recorded("vm_stat-16384-head.txt")) == (
        (3857 + 443760 + 1075) * 16384
    )
    assert macos.parse_vm_stat(recorded("vm_stat-4096.txt")) == ((6127229 + 628646 + 430715) * 4096)
    # sw_vers: -productVersion (the probe's), and plain sw_vers of a first release (x.y)
    assert macos.parse_sw_vers(recorded(SW_VERS_OLD)) == (10, 13, 6)
    assert macos.parse_sw_vers(recorded("sw_vers-10.13.txt")) == (10, 13)
    # sysctl NAME at macOS's default: 0 (the doctor then takes 75 % of hw.memsize)
    assert macos.parse_sysctl_int(recorded(WIRED_DEFAULT)) == 0
    # documented forms
    assert macos.parse_sw_vers(DOCUMENTED_SW_VERS) == (26, 2)
    assert [macos.parse_sysctl_int(t) for t in DOCUMENTED_WIRED] == [0, 480000, 480000]
    assert macos.parse_sysctl_int("sysctl: unknown oid 'iogpu.wired_limit_mb'") is None


def _facts(**kw) -> dict:
    f = {
        "folders": {"0": {"ok": True, "why": "", "bytes": 400 * 10**9}},
        "t": 100.0,
        "sent": 99.9,
        "answered": 100.2,
        "env": {},
        "mem_available": macos.parse_vm_stat(recorded("vm_stat-4096.txt")),
        "disk_free": 100 * 10**9,
        "disk_path": "/Volumes/models",
        "sw_vers": "26.2\n",
        "wired_limit_mb": recorded(WIRED_DEFAULT),
        "mem_total": str(512 * 2**30),
        "pmset": recorded("pmset-g-macbook-pro-arm64.txt"),
        "thunderbolt": recorded(STUDIO_TB),
        "rdma_ctl": recorded("rdma_ctl-status-mac-mini-m4-pro.txt"),
        "ibv_devices": recorded("ibv_devices-omlx-cluster.txt"),
        "ibv_devinfo": recorded("ibv_devinfo-omlx-cluster.txt"),
    }
    f.update(kw)
    return f


def _plan(backend: str = "jaccl", rdma: str = "rdma_en2") -> doctor.Plan:
    from k3dist.config.deployment import Deployment

    from mlx._distributed_utils.common import Host

    hosts = [
        Host(0, "mac1", ["10.10.0.1"], [None, rdma]),
        Host(1, "mac2", ["10.10.0.2"], [rdma, None]),
    ]
    return doctor.Plan(hosts, backend, [], Deployment(memory_headroom_gib=44), 32323, "", "", False)


def _by_name(checks) -> dict:
    return {c.name: c for c in checks}


def test_macos_checks_pass_on_the_recorded_outputs():
    ok = _by_name(doctor._resource_checks("mac1", _facts(), _plan()))
    for name in ("macOS for JACCL", "Thunderbolt 5", "RDMA devices", "RDMA ports linked"):
        assert ok[name].ok, ok[name].line()
    assert ok["sleep disabled"].ok, ok["sleep disabled"].line()  # SleepDisabled 1
    # 512 GiB x 75 % (the default wired limit) = 412 GB < 400 GB + 44 GiB
    assert not ok["iogpu.wired_limit_mb"].ok, ok["iogpu.wired_limit_mb"].line()
    assert "sysctl iogpu.wired_limit_mb=" in ok["iogpu.wired_limit_mb"].line()
    raised = _by_name(
        doctor._resource_checks("mac1", _facts(wired_limit_mb=DOCUMENTED_WIRED[2]), _plan())
    )
    assert raised["iogpu.wired_limit_mb"].ok, raised["iogpu.wired_limit_mb"].line()
    # 4096-byte pages: 7.2 M pages x 4 KiB = 29 GB free < the plan's 447 GB
    assert not ok["free memory"].ok and "29.4 GB available" in ok["free memory"].detail


def test_macos_checks_fail_on_the_recorded_outputs():
    # the hostfile names rdma_en1: listed, but its port is down (the cable is in en2's)
    wrong_port = _by_name(doctor._resource_checks("mac1", _facts(), _plan(rdma="rdma_en1")))
    assert not wrong_port["RDMA ports linked"].ok, wrong_port["RDMA ports linked"].line()
    assert "rdma_en1" in wrong_port["RDMA ports linked"].detail
    assert "rdma_en2" in wrong_port["RDMA ports linked"].detail  # the active one, named
    bad = _by_name(
        doctor._resource_checks(
            "mac1",
            _facts(
                sw_vers=recorded(SW_VERS_OLD),
                thunderbolt=tb4(recorded(MACBOOK_TB)),
                ibv_devices=recorded("ibv_devices-rdma-disabled.txt"),
                ibv_devinfo="",
                pmset=recorded("pmset-g-macbook-pro-arm64.txt").replace(
                    " SleepDisabled\t\t1\n", ""
                ),
                t=105.0,
            ),
            _plan(),
        )
    )
    for name in ("macOS for JACCL", "Thunderbolt 5", "RDMA devices"):
        assert not bad[name].ok and bad[name].fatal, bad[name].line()
    assert "40 Gb/s" in bad["Thunderbolt 5"].detail
    assert "macOS 10.13.6 (JACCL needs 26.2+)" in bad["macOS for JACCL"].detail
    # rdma_ctl says enabled, yet no device (mlx#3777): the fix is a cold start, not enable
    assert "no device is listed" in bad["RDMA devices"].fix
    off = _by_name(
        doctor._resource_checks(
            "mac1", _facts(rdma_ctl="disabled\n", ibv_devices="", ibv_devinfo=""), _plan()
        )
    )
    assert "rdma_ctl enable" in off["RDMA devices"].fix
    assert not bad["sleep disabled"].ok and not bad["sleep disabled"].fatal
    assert "pmset -a sleep 0" in bad["sleep disabled"].fix
    assert not bad["clock skew"].ok and "4.80 s" in bad["clock skew"].detail
    ring = _by_name(
        doctor._resource_checks("mac1", _facts(sw_vers=recorded(SW_VERS_OLD)), _plan("ring"))
    )
    assert "macOS for JACCL" not in ring  # the ring backend runs on older macOS


def test_clock_skew_is_read_at_the_probes_start():
    # sent at 0, answered at 31 s: 1 s of ssh and interpreter, 30 s of probe (a folder
    # hashed, system_profiler); a clock 10 s behind reads 20.5 s at the probe's end, inside
    # [0, 31]: only its start, against the round trip less the probe's run time, shows it
    assert doctor.clock_skew(-9.5, 20.5, 0.0, 31.0) == 9.5
    assert doctor.clock_skew(0.5, 30.5, 0.0, 31.0) == 0.0  # the same probe, clock right
    assert doctor.clock_skew(0.5, 30.5, 0.0, 31.0 + 5) == 0.0  # a slow answer: still 0
    assert doctor.clock_skew(36.0, 66.0, 0.0, 31.0) == 35.0  # a clock ahead
    assert round(doctor.clock_skew(105.0, 105.0, 99.9, 100.2), 2) == 4.8  # no run time


def test_environment_must_match_on_every_host():
    facts = {"mac1": _facts(env={"MLX_METAL_FAST_SYNCH": "1"}), "mac2": _facts(env={})}
    checks = doctor._cluster_checks(facts, _plan(), "mac1")
    assert [c.ok for c in checks] == [True, False], [c.line() for c in checks]
    assert "MLX_METAL_FAST_SYNCH" in checks[1].detail


def test_a_deployments_boxes_are_checked_on_each_mac():
    """A deployment listing its boxes (deploy/tb5-3.yaml): the Mac serving rank 1 must
    have rank 1's listed memory and at least its listed wired limit."""
    from k3dist.config.deployment import load_deployment

    plan = _plan()
    plan.dep = load_deployment(REPO / "deploy" / "tb5-3.yaml")
    one = {"1": {"ok": True, "why": "", "bytes": 150 * 10**9}}
    ok = _by_name(
        doctor._box_checks(
            "mac2", _facts(folders=one, mem_total=str(256 * 2**30), wired_limit_mb="237568\n"), plan
        )
    )
    assert ok["rank 1 box memory"].ok and ok["rank 1 wired limit"].ok, ok
    bad = _by_name(doctor._box_checks("mac2", _facts(folders=one, wired_limit_mb="0\n"), plan))
    assert not bad["rank 1 box memory"].ok
    assert "512 GiB here, the deployment lists 256 GiB" in bad["rank 1 box memory"].detail
    assert not bad["rank 1 wired limit"].ok
    assert "sudo sysctl iogpu.wired_limit_mb=237568" in bad["rank 1 wired limit"].line()
    plan.dep = load_deployment(REPO / "deploy" / "tb5.yaml")  # no boxes: no such checks
    assert doctor._box_checks("mac2", _facts(folders=one), plan) == []
