"""Room in a prompt's stock mlx_lm caches for the whole prompt, made once.

A stock ``KVCache`` grows by copying itself whole whenever a chunk does not fit (in 256-token
steps), so a long prompt fed in chunks copies its cache about once a chunk (quadratic in the
prompt), and a cache started from cached pages copies them again at its first chunk. The
engine's prefill (``engine.loop.prefill``) and prompt scoring (``engine.request.scoring``)
give their caches room for the whole prompt instead: the chunks then write in place.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache


def joined(parts: list[mx.array], room: int) -> mx.array:
    """``parts`` ``[1, H, n, D]`` one after the other, then ``room`` positions of zeros: one
    copy."""
    first = parts[0]
    shape = (*first.shape[:2], room, first.shape[3])
    return mx.concatenate([*parts, mx.zeros(shape, dtype=first.dtype)], axis=2)


def make_room(caches: list[Any], positions: int) -> None:
    """Give stock ``KVCache``s room for ``positions`` in all (what they hold copied once);
    other caches (a sliding window's, bounded) are left as they are."""
    for cache in caches:
        keys, values = cache.keys, cache.values
        if type(cache) is KVCache and keys is not None and keys.shape[2] < positions:
            room = positions - cache.offset
            cache.keys = joined([keys[..., : cache.offset, :]], room)
            cache.values = joined([values[..., : cache.offset, :]], room)
