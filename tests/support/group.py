"""Processes of one mx.distributed group on loopback (the ring backend), started by pid."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from loadtest.proc import ring_hostfile


def rank_env(hostfile: Path, rank: int) -> dict[str, str]:
    return {**os.environ, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)}


def start_ranks(
    cmd: list[str], tmp_path: Path, n: int = 2, extra: dict[int, list[str]] | None = None
) -> list[tuple[subprocess.Popen, Path]]:
    """``cmd`` as ranks 0..n-1 (followers first), each logging to its own file."""
    hostfile = ring_hostfile(tmp_path, n)
    procs: list[tuple[subprocess.Popen, Path]] = []
    for rank in reversed(range(n)):
        log = tmp_path / f"rank{rank}-{hostfile.stem}.log"
        args = cmd + (extra or {}).get(rank, [])
        with open(log, "w") as fh:
            proc = subprocess.Popen(
                args, stdout=fh, stderr=subprocess.STDOUT, env=rank_env(hostfile, rank)
            )
        procs.append((proc, log))
    return list(reversed(procs))


def kill_all(procs: list[tuple[subprocess.Popen, Path]]) -> None:
    """Stop every rank still running (SIGCONT first: a test may have stopped one)."""
    for proc, _ in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(10)
