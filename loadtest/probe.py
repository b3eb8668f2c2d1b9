"""Reading our server's /metrics during a run: peak blocks, rejections, the leak check."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families


async def scrape(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """Flattened samples of /metrics (name{labels} -> value), or None if it is not ours."""
    try:
        r = await client.get(f"{base_url}/metrics", timeout=5)
    except httpx.HTTPError:
        return None
    if r.status_code != 200 or "veloxquant_block_pool_blocks_in_use" not in r.text:
        return None
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


@dataclass
class Probe:
    """Scrapes every ``interval`` seconds while a run goes on; keeps the peaks."""

    base_url: str
    interval: float = 1.0  # a scrape costs the client ~2 ms of CPU, which the load competes for
    peak_blocks_in_use: float = 0.0
    peak_running: float = 0.0
    peak_waiting: float = 0.0
    before: dict[str, float] | None = None
    after: dict[str, float] | None = None
    samples: int = 0
    _task: asyncio.Task | None = field(default=None, repr=False)

    async def start(self, client: httpx.AsyncClient) -> bool:
        self.before = await scrape(client, self.base_url)
        if self.before is None:
            return False
        self._task = asyncio.create_task(self._loop(client))
        return True

    async def _loop(self, client: httpx.AsyncClient) -> None:
        while True:
            m = await scrape(client, self.base_url)
            if m is not None:
                self.samples += 1
                self.peak_blocks_in_use = max(
                    self.peak_blocks_in_use, m.get("veloxquant_block_pool_blocks_in_use", 0)
                )
                self.peak_running = max(self.peak_running, m.get("veloxquant_requests_running", 0))
                self.peak_waiting = max(self.peak_waiting, m.get("veloxquant_requests_waiting", 0))
            await asyncio.sleep(self.interval)

    async def stop(self, client: httpx.AsyncClient, idle_timeout: float = 30.0) -> dict:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        # the leak check: once idle, every block is free and nothing runs or waits
        loop = asyncio.get_running_loop()
        deadline = loop.time() + idle_timeout
        while True:
            self.after = await scrape(client, self.base_url)
            if (self.after and _idle(self.after)) or loop.time() > deadline:
                break
            await asyncio.sleep(0.1)
        after = self.after or {}
        before = self.before or {}

        def delta(prefix: str) -> dict[str, float]:
            return {
                k: after[k] - before.get(k, 0.0)
                for k in after
                if k.startswith(prefix) and after[k] - before.get(k, 0.0)
            }

        return {
            "peak_blocks_in_use": self.peak_blocks_in_use,
            "peak_running": self.peak_running,
            "peak_waiting": self.peak_waiting,
            "blocks_total": after.get("veloxquant_block_pool_blocks", 0.0),
            "kv_capacity_bytes": after.get("veloxquant_kv_cache_capacity_bytes", 0.0),
            "peak_kv_bytes": self.peak_blocks_in_use
            * after.get("veloxquant_kv_bytes_per_block", 0),
            "rejections": delta("veloxquant_requests_rejected_total"),
            "leak_free": bool(self.after and _idle(self.after)),
            "scrapes": self.samples,
        }


def _idle(m: dict[str, float]) -> bool:
    """Nothing running or waiting, and no block held for a request: the pool's blocks in use
    are all cached pages no request holds (evictable), if any."""
    held = m.get("veloxquant_block_pool_blocks_in_use", 1) - m.get(
        "veloxquant_prefix_cache_evictable_blocks", 0
    )
    return (
        held == 0
        and m.get("veloxquant_requests_running", 1) == 0
        and m.get("veloxquant_requests_waiting", 1) == 0
    )
