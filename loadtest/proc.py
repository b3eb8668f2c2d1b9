"""Process helpers for harnesses that start servers on loopback: a free port, /proc memory
fields, and a server context that waits for ``/v1/models`` and stops the process by pid."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ring_hostfile(directory: Path, n: int) -> Path:
    """A hostfile for ``n`` ranks of MLX's ring backend on free 127.0.0.1 ports, in the format
    ``mlx.launch`` writes (one list of "ip:port" per rank): set ``MLX_HOSTFILE`` to it and
    ``MLX_RANK`` per process."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
    path = directory / f"hosts-{ports[0]}.json"
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    return path


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a server's engine process is its child)."""
    pids, i = [pid], 0
    while i < len(pids):
        for task in Path(f"/proc/{pids[i]}/task").glob("*/children"):
            with suppress(OSError):
                pids.extend(int(c) for c in task.read_text().split())
        i += 1
    return pids


def proc_status_mb(pid: int, field: str) -> float:
    """A /proc/<pid>/status memory field (VmRSS, VmHWM, ...) in MiB, summed over ``pid`` and
    its descendants (VmHWM: the sum of each one's peak); NaN if unreadable."""
    total, seen = 0.0, False
    for p in _tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith(f"{field}:"):
                    total += int(line.split()[1]) / 1024
                    seen = True
        except OSError:
            pass
    return total if seen else float("nan")


def peak_rss_mb(pid: int) -> float:
    return proc_status_mb(pid, "VmHWM")


@contextmanager
def server(cmd: list[str], port: int, env: dict[str, str], log: Path):
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0:3]} exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def stop(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if it overstays ``timeout``."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@contextmanager
def smg_router(policy: str, log: Path, *extra: str):
    """A real SMG router (``smg launch``, PyPI ``smg``) on a free loopback port, with no
    workers (replicas join it with ``--register-with``); health-checks ``/ready`` and polls
    ``/v1/loads`` every second. Yields its URL; stopped by pid."""
    smg = shutil.which("smg") or str(Path(sys.executable).parent / "smg")
    port, metrics_port = free_port(), free_port()
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
             "--health-check-endpoint", "/ready", "--health-check-interval-secs", "1",
             "--load-monitor-interval", "1", "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(metrics_port), *extra],
            stdout=fh, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"smg did not start: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        stop(proc)
