"""MLX settings that MLX reads from the environment once, at the first use of its backend: set
here, before the engine loads, from the server's settings. A value already in the environment
(the operator's own) is kept."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# setting name -> MLX's environment variable (its CUDA backend's; the others ignore them)
VARIABLES = {
    "cuda_graph_ops": "MLX_MAX_OPS_PER_BUFFER",
    "cuda_graph_cache": "MLX_CUDA_GRAPH_CACHE_SIZE",
    "cuda_sdpa_cache": "MLX_CUDA_SDPA_CACHE_SIZE",
    "cuda_thrashing_check": "MLX_ENABLE_CACHE_THRASHING_CHECK",
}


def apply(
    values: dict[str, int | bool | None], env: MutableMapping[str, str] = os.environ
) -> dict[str, str]:
    """Put each set value into ``env`` under its MLX variable (a flag as 1 or 0) unless that
    is set already; returns what was set (for the log)."""
    applied = {}
    for name, variable in VARIABLES.items():
        value = values.get(name)
        if value is not None and variable not in env:
            env[variable] = applied[variable] = str(int(value))
    return applied
