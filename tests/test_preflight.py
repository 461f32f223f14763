"""Memory preflight: the real folder against this machine, pretend numbers for Metal."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from k3dist.serve import preflight
from k3dist.serve.preflight import GiB, MiB, PreflightError

import mlx.core as mx
import pytest


def test_preflight_fits_and_reports(mini_build):
    report = preflight.preflight(mini_build, headroom_bytes=64 * MiB)
    files = sorted(Path(mini_build).glob("*.safetensors"))
    data = 0
    for f in files:  # data = file minus the 8-byte length and the JSON header
        n = int.from_bytes(f.read_bytes()[:8], "little")
        data += f.stat().st_size - 8 - n
    assert report["weights_bytes"] == data > 0
    assert report["footprint_bytes"] == data + 64 * MiB
    assert report["free_bytes"] > report["footprint_bytes"]
    assert report["free_source"].startswith("/proc/meminfo" if sys.platform == "linux"
                                            else "vm_stat")
    if not mx.metal.is_available():
        assert report["metal"] is None and report["wired_limit_set_bytes"] is None
    else:
        assert report["wired_limit_set_bytes"] == report["footprint_bytes"]
    json.dumps(report)  # serve prints it as evidence


def test_preflight_refuses_with_numbers_and_fix(mini_build):
    footprint = preflight.folder_weight_bytes(mini_build) + GiB
    with pytest.raises(PreflightError) as e:
        preflight.preflight(mini_build, headroom_bytes=GiB, free_bytes=footprint - 4096)
    msg = str(e.value)
    assert f"{footprint:,} bytes" in msg and f"{footprint - 4096:,} bytes" in msg
    assert "fix:" in msg and "--size" in msg and str(mini_build) in msg


def test_preflight_refuses_a_folder_without_weights(tmp_path):
    with pytest.raises(PreflightError, match="no \\*.safetensors"):
        preflight.preflight(tmp_path, headroom_bytes=GiB)


def test_metal_wired_limit_fix_names_the_sysctl():
    metal = {"max_recommended_working_set_bytes": 96 * GiB, "memory_bytes": 128 * GiB,
             "iogpu_wired_limit_mb": 0}
    weights, head = 100 * GiB, 8 * GiB
    with pytest.raises(PreflightError) as e:
        preflight.check_memory("rank0", weights, head, 120 * GiB, "given", metal)
    assert f"sudo sysctl iogpu.wired_limit_mb={(weights + head) // MiB}" in str(e.value)
    # Beyond what the machine can wire at all: no sysctl can help, say so.
    with pytest.raises(PreflightError, match="more than this machine can wire") as e:
        preflight.check_memory("rank0", 126 * GiB, head, 200 * GiB, "given", metal)
    assert "sysctl" not in str(e.value)
    assert preflight.check_memory("rank0", 80 * GiB, head, 120 * GiB, "given", metal) == 88 * GiB


def test_free_memory_parsers():
    vm_stat = ("Mach Virtual Memory Statistics: (page size of 16384 bytes)\n"
               "Pages free:                               10000.\n"
               "Pages active:                            500000.\n"
               "Pages inactive:                           20000.\n"
               "Pages speculative:                         3000.\n")
    assert preflight.parse_vm_stat(vm_stat) == 30000 * 16384
    assert preflight.parse_meminfo("MemTotal: 100 kB\nMemAvailable:   2048 kB\n") == 2048 * 1024
    with pytest.raises(ValueError, match="MemAvailable"):
        preflight.parse_meminfo("MemTotal: 100 kB\n")
