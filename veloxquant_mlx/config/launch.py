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
