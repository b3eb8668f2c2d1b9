"""Whether a distributed launcher started this process (no MLX: settings read it too)."""

from __future__ import annotations

import os

# Set by mlx.launch (ring, jaccl, nccl) or by MPI's launchers.
RANK_VARIABLES = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def launched_rank() -> int | None:
    """This process's rank when a distributed launcher started it, else None."""
    for name in RANK_VARIABLES:
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return None


def ranks_on_this_host() -> int | None:
    """How many ranks of the group share this host, from the ring hostfile mlx.launch writes
    (``MLX_HOSTFILE``: one list of "ip:port" per rank); None if it cannot tell."""
    import json

    rank, path = launched_rank(), os.environ.get("MLX_HOSTFILE")
    if rank is None or not path:
        return None
    try:
        with open(path) as fh:
            hosts = [[str(a).rsplit(":", 1)[0] for a in entry] for entry in json.load(fh)]
        mine = set(hosts[rank])
    except (OSError, ValueError, TypeError, IndexError):
        return None
    return sum(1 for entry in hosts if mine & set(entry))


def share_cpu_threads() -> int | None:
    """In a group whose ranks share this host's cores, give each rank's BLAS its share of them
    (``OPENBLAS_NUM_THREADS``, unless set): OpenBLAS threads spin while they wait, and ranks
    that each start one per core slow every step down (BENCHMARKS.md, "One model over
    mx.distributed"). Call before MLX loads its BLAS. Returns the threads set, or None."""
    if "OPENBLAS_NUM_THREADS" in os.environ:
        return None
    local = ranks_on_this_host()
    if local is None or local < 2:
        return None
    threads = max(1, (os.cpu_count() or 1) // local)
    os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
    return threads
