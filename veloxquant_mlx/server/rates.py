"""A rate from a running total: what ``/v1/loads`` reports as generation throughput."""

from __future__ import annotations

import collections
import threading
import time


class RateWindow:
    """Generated tokens per second over the last ``window`` seconds, from the engine's running
    total read at each poll (several routers polling share one window). Owns its samples,
    guarded by a lock (polls run concurrently)."""

    def __init__(self, window: float = 10.0) -> None:
        self.window = window
        self._samples: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()

    def update(self, total: int, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            samples = self._samples
            samples.append((now, total))
            while len(samples) > 2 and now - samples[1][0] >= self.window:
                samples.popleft()
            t0, n0 = samples[0]
            return (total - n0) / (now - t0) if now > t0 else 0.0
