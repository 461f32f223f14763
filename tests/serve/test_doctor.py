"""k3dist-doctor's macOS-only probes, parsed from command outputs (no Mac here).

Where the outputs come from: nobody on this project has a Mac, so none was recorded
from one. Each sample below is written in the format the parser's other reader expects:
``system_profiler SPThunderboltDataType -json`` with the keys mlx's own
``mlx.distributed_config`` reads (mlx/_distributed_utils/config.py,
``extract_connectivity``: ``domain_uuid_key``, ``receptacle_1_tag``, ``_items``) plus
``current_speed_key``; ``ibv_devices`` as mlx's ``check_rdma`` reads it (names starting
``rdma_``); ``sw_vers``, ``pmset -g``, ``vm_stat`` and ``sysctl`` in the layout of their
man pages. Replace them with outputs recorded on the two Macs when a Mac is at hand
(docs/two-hosts.md says how). The live checks run on the rig (tests/serve/test_two_hosts.py).
"""

from __future__ import annotations

import json

from k3dist.serve import doctor

SW_VERS = "ProductName:\t\tmacOS\nProductVersion:\t\t26.2\nBuildVersion:\t\t25C56\n"
SW_VERS_OLD = "ProductName:\t\tmacOS\nProductVersion:\t\t15.6.1\nBuildVersion:\t\t24G90\n"
PMSET = """System-wide power settings:
Currently in use:
 standby              0
 Sleep On Power Button 1
 hibernatemode        0
 powernap             0
 disksleep            10
 sleep                0 (sleep prevented by sharingd)
 displaysleep         10
"""
PMSET_SLEEPS = PMSET.replace(" sleep                0 (sleep prevented by sharingd)", " sleep 1")
VM_STAT = """Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                               1000000.
Pages active:                             2000000.
Pages inactive:                            500000.
Pages speculative:                         100000.
Pages wired down:                         9000000.
"""
IBV = """    device          	   node GUID
    ------          	----------------
    rdma_en5        	0000000000000000
    rdma_en6        	0000000000000000
"""


def _tb(speed: str, connected: bool) -> str:
    item = {"domain_uuid_key": "PEER-UUID", "device_name_key": "Mac Studio"}
    return json.dumps(
        {
            "SPThunderboltDataType": [
                {
                    "_name": "thunderbolt_bus_1",
                    "device_name_key": "Mac Studio",
                    "domain_uuid_key": "SELF-UUID",
                    "receptacle_1_tag": {"receptacle_id_key": "1", "current_speed_key": speed},
                    "_items": [item] if connected else [],
                }
            ]
        }
    )


def test_parsers_read_the_macos_outputs():
    assert doctor.parse_sw_vers(SW_VERS) == (26, 2)
    assert doctor.parse_sw_vers("26.2\n") == (26, 2)
    assert doctor.parse_sw_vers(SW_VERS_OLD) == (15, 6, 1)
    assert doctor.parse_pmset_sleep(PMSET) == 0
    assert doctor.parse_pmset_sleep(PMSET_SLEEPS) == 1
    assert doctor.parse_vm_stat(VM_STAT) == (1000000 + 500000 + 100000) * 16384
    assert doctor.parse_ibv_devices(IBV) == ["rdma_en5", "rdma_en6"]
    assert doctor.parse_ibv_devices("") == []
    tb5 = doctor.parse_thunderbolt(_tb("Up to 80 Gb/s", True))
    assert tb5 == [{"name": "thunderbolt_bus_1", "speed": "Up to 80 Gb/s", "connected": True}]
    assert doctor.tb_generation("Up to 80 Gb/s") == 5
    assert doctor.tb_generation("Up to 40 Gb/s") == 4


def _facts(**kw) -> dict:
    f = {
        "folders": {"0": {"ok": True, "why": "", "bytes": 400 * 10**9}},
        "t": 100.0,
        "sent": 99.9,
        "answered": 100.2,
        "env": {},
        "mem_available": 500 * 10**9,
        "disk_free": 100 * 10**9,
        "disk_path": "/Volumes/models",
        "sw_vers": "26.2\n",
        "wired_limit_mb": "0\n",
        "mem_total": str(512 * 2**30),
        "pmset": PMSET,
        "thunderbolt": _tb("Up to 80 Gb/s", True),
        "ibv_devices": IBV,
    }
    f.update(kw)
    return f


def _plan(backend: str = "jaccl") -> doctor.Plan:
    from k3dist.config.deployment import Deployment

    from mlx._distributed_utils.common import Host

    hosts = [
        Host(0, "mac1", ["10.10.0.1"], [None, "rdma_en5"]),
        Host(1, "mac2", ["10.10.0.2"], ["rdma_en5", None]),
    ]
    return doctor.Plan(hosts, backend, [], Deployment(memory_headroom_gib=44), 32323, "", "", False)


def _by_name(checks) -> dict:
    return {c.name: c for c in checks}


def test_macos_checks_pass_and_fail_on_the_outputs():
    plan = _plan()
    ok = _by_name(doctor._resource_checks("mac1", _facts(), plan))
    for name in ("macOS for JACCL", "Thunderbolt 5", "RDMA devices", "sleep disabled"):
        assert ok[name].ok, ok[name].line()
    # 512 GiB x 75 % (the default wired limit) = 412 GB < 400 GB + 44 GiB
    assert not ok["iogpu.wired_limit_mb"].ok, ok["iogpu.wired_limit_mb"].line()
    assert "sysctl iogpu.wired_limit_mb=" in ok["iogpu.wired_limit_mb"].line()
    raised = _by_name(doctor._resource_checks("mac1", _facts(wired_limit_mb="480000\n"), plan))
    assert raised["iogpu.wired_limit_mb"].ok, raised["iogpu.wired_limit_mb"].line()

    bad = _by_name(
        doctor._resource_checks(
            "mac1",
            _facts(
                sw_vers=SW_VERS_OLD,
                thunderbolt=_tb("Up to 40 Gb/s", True),
                ibv_devices="",
                pmset=PMSET_SLEEPS,
                t=105.0,
            ),
            plan,
        )
    )
    for name in ("macOS for JACCL", "Thunderbolt 5", "RDMA devices"):
        assert not bad[name].ok and bad[name].fatal, bad[name].line()
    assert "rdma_ctl enable" in bad["RDMA devices"].fix
    assert not bad["sleep disabled"].ok and not bad["sleep disabled"].fatal
    assert "pmset -a sleep 0" in bad["sleep disabled"].fix
    assert not bad["clock skew"].ok and "4.80 s" in bad["clock skew"].detail
    ring = _by_name(doctor._resource_checks("mac1", _facts(sw_vers=SW_VERS_OLD), _plan("ring")))
    assert "macOS for JACCL" not in ring  # the ring backend runs on older macOS


def test_environment_must_match_on_every_host():
    facts = {"mac1": _facts(env={"MLX_METAL_FAST_SYNCH": "1"}), "mac2": _facts(env={})}
    checks = doctor._cluster_checks(facts, _plan(), "mac1")
    assert [c.ok for c in checks] == [True, False], [c.line() for c in checks]
    assert "MLX_METAL_FAST_SYNCH" in checks[1].detail
