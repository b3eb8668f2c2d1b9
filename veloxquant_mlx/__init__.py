"""VeloxQuant-MLX serve: a multi-request MLX inference server on one accounted KV block pool.

Top-level exports are the seed's ``KVCacheBuilder`` and ``KVCacheConfig``, loaded on first use
(they need MLX). The pool lives in ``veloxquant_mlx.pool`` and is re-exported, with the pooled
caches, from ``veloxquant_mlx.memory``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "KVCacheBuilder": "veloxquant_mlx.cache.veloxquant",
    "KVCacheConfig": "veloxquant_mlx.cache.veloxquant",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
