"""``--register-with ROUTER``: this server joins an SMG router's workers at start and leaves
them when it drains, so a fleet scales by starting and stopping servers (no router restart).

SMG's control plane: ``POST /workers {"url", "runtime": "mlx"}`` registers (the router then
health-checks the worker, ``/ready`` when started with ``--health-check-endpoint /ready``, and
polls ``/v1/loads``); ``GET /workers`` lists them with their ids; ``DELETE /workers/{id}``
removes one. With ``--api-key`` set, the key goes in the registration's ``api_key`` (SMG
sends it to this worker on every call: ``/v1/*`` needs it); it is never sent as the router's
own credential. A router that is down at start is retried in the background; registration
never blocks serving, and a failure is a warning in the log.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import httpx

log = logging.getLogger("veloxquant.server")


class Registration:
    """This server's entry in one router. Owns ``registered`` (guarded by ``_lock``: the
    event loop registers, the drain thread deregisters)."""

    def __init__(self, router_url: str, worker_url: str, api_key: str | None = None) -> None:
        self.router_url = router_url.rstrip("/")
        self.worker_url = worker_url.rstrip("/")
        self._api_key = api_key
        self._lock = threading.Lock()
        self.registered = False
        self._left = False

    async def register(self, attempts: int = 60, interval: float = 1.0) -> bool:
        """POST this worker to the router, retrying while it is unreachable or refuses."""
        body: dict[str, str] = {"url": self.worker_url, "runtime": "mlx"}
        if self._api_key:
            body["api_key"] = self._api_key
        async with httpx.AsyncClient(timeout=5.0) as client:
            for attempt in range(attempts):
                if self._left:
                    return False
                try:
                    r = await client.post(f"{self.router_url}/workers", json=body)
                    if r.status_code < 300:
                        with self._lock:
                            self.registered = not self._left
                        log.info("registered %s with the router %s", self.worker_url,
                                 self.router_url)  # fmt: skip
                        return True
                    why = f"HTTP {r.status_code}"
                except httpx.HTTPError as exc:
                    why = type(exc).__name__
                if attempt == 0:
                    log.warning("router %s not accepting yet (%s); retrying", self.router_url, why)
                await asyncio.sleep(interval)
        log.warning("could not register with the router %s", self.router_url)
        return False

    def deregister(self) -> bool:
        """Remove this worker from the router (blocking; any thread). Idempotent."""
        with self._lock:
            self._left = True
            if not self.registered:
                return False
            self.registered = False
        try:
            with httpx.Client(timeout=5.0) as client:
                listing = client.get(f"{self.router_url}/workers").json()
                ids = [
                    w.get("id")
                    for w in listing.get("workers", [])
                    if str(w.get("url", "")).rstrip("/") == self.worker_url
                ]
                for worker_id in ids:
                    client.delete(f"{self.router_url}/workers/{worker_id}")
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("could not deregister from the router %s: %s", self.router_url,
                        type(exc).__name__)  # fmt: skip
            return False
        log.info("deregistered %s from the router %s", self.worker_url, self.router_url)
        return True
