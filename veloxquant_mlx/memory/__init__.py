"""``veloxquant_mlx.memory``: the seed's public import path for the block pool and pooled caches.

Re-exports only. The pool names import no MLX; the cache names are loaded on first use, so
``from veloxquant_mlx.memory import BlockPoolAllocator`` works on a machine without MLX.
"""

from __future__ import annotations

import importlib
from typing import Any

from veloxquant_mlx.pool import (
    AllocationStats,
    Block,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    OwnerAlreadyActiveError,
    PoolConfig,
)

# name -> module that defines it (imported lazily: these need MLX).
_LAZY = {
    "MLXBlockStorage": "veloxquant_mlx.cache.block_storage",
    "PooledKVCache": "veloxquant_mlx.cache.pooled",
    "PoolBackedKVCache": "veloxquant_mlx.cache.pool_backed",
    "build_pooled_caches": "veloxquant_mlx.cache.pool_backed",
}

__all__ = [
    "AllocationStats",
    "Block",
    "BlockPoolAllocator",
    "BlockPoolExhaustedError",
    "OwnerAlreadyActiveError",
    "PoolConfig",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
