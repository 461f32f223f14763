"""Admission: how many completions may be in flight (queued or generating) at once; past
that a request gets 429 with a Retry-After from the recent time per request."""

from __future__ import annotations

import math
import threading


class Admission:
    """How many completions may be in flight (queued or generating) at once; past
    that a request gets 429 with a Retry-After from the recent time per request."""

    def __init__(self, limit: int):
        self.limit, self.in_flight, self.seconds = limit, 0, 1.0
        self.lock = threading.Lock()

    def enter(self) -> bool:
        with self.lock:
            if self.in_flight >= self.limit:
                return False
            self.in_flight += 1
            return True

    def leave(self, seconds: float) -> None:
        with self.lock:
            self.in_flight -= 1
            self.seconds = 0.8 * self.seconds + 0.2 * seconds

    def retry_after(self) -> int:
        return max(1, min(60, math.ceil(self.seconds)))
