"""``veloxquant_mlx.memory.pooled_cache``: the seed's submodule path for PooledKVCache."""

from veloxquant_mlx.cache.pooled import PooledKVCache

__all__ = ["PooledKVCache"]
