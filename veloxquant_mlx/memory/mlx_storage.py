"""``veloxquant_mlx.memory.mlx_storage``: the seed's submodule path for MLXBlockStorage."""

from veloxquant_mlx.cache.block_storage import MLXBlockStorage

__all__ = ["MLXBlockStorage"]
