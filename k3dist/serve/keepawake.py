"""Device keep-awake: a tiny op every interval so an idle Metal GPU does not sleep
between requests."""

from __future__ import annotations

import os
import threading

import mlx.core as mx


class DeviceHeartbeat:
    """Evaluate a one-element op every ``interval_s`` so an idle Metal GPU stays awake
    (a GPU that has clocked down adds latency to the first token after a pause).

    It runs on its own stream, created inside its thread (MLX streams belong to the
    thread that made them), and never issues a collective: a collective from a side
    thread would break the same-order-on-every-rank rule. (Idle ranks issue none
    either: they wait on the watchdog's socket, not in mlx_lm.server's old idle poll
    of an ``all_sum`` every 0.1 s, which spun a core; the watchdog's heartbeat keeps
    the side channel alive.) On CPU it runs too (cheap), so it is tested here.
    """

    def __init__(self, interval_s: float = 1.0, device: mx.Device | None = None):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, not {interval_s}")
        self.interval_s = interval_s
        self.device = device or mx.default_device()
        self.beats = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> DeviceHeartbeat:
        self._thread = threading.Thread(
            target=self._run, daemon=True, name="k3dist-device-heartbeat"
        )
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            stream = mx.new_stream(self.device)
            x = mx.zeros((1,), stream=stream)
            while not self._stop.is_set():
                x = mx.add(x, 1, stream=stream)
                mx.eval(x)
                self.beats += 1
                self._stop.wait(self.interval_s)
        except Exception as e:  # noqa: BLE001 - a heartbeat must never take the rank down
            self.error = e
            os.write(2, f"[k3dist device heartbeat] stopped: {type(e).__name__}: {e}\n".encode())
