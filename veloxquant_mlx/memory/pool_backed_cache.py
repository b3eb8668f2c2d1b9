"""``veloxquant_mlx.memory.pool_backed_cache``: the seed's submodule path for the mlx_lm drop-in."""

from veloxquant_mlx.cache.pool_backed import PoolBackedKVCache, build_pooled_caches

__all__ = ["PoolBackedKVCache", "build_pooled_caches"]
