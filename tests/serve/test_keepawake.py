"""Device keep-awake heartbeat, on this machine's device."""

from __future__ import annotations

import time

from k3dist.serve import keepawake

import mlx.core as mx


def test_device_heartbeat_beats_at_its_interval():
    hb = keepawake.DeviceHeartbeat(interval_s=0.05).start()
    t0 = time.monotonic()
    a = mx.random.normal((256, 256))
    while time.monotonic() - t0 < 1.0:  # the main thread keeps evaluating meanwhile
        mx.eval(a @ a)
    hb.stop()
    dt = time.monotonic() - t0
    assert hb.error is None and not hb.alive
    assert dt / 0.05 * 0.5 <= hb.beats <= dt / 0.05 + 2, (hb.beats, dt)
    print(f"\ndevice heartbeat: {hb.beats} beats in {dt:.2f} s at a 0.05 s interval")
