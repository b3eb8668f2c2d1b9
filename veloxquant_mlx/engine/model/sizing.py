"""KV geometry of a loaded model and pool sizing from a memory budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from veloxquant_mlx.kv.codec import KVCodec
from veloxquant_mlx.pool import PoolConfig


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """What one token of KV costs in the layers the pool accounts.

    Attributes:
        n_layers: Layers whose cache is pool-backed (plain KV layers).
        n_layers_total: All layers of the model.
        n_kv_heads: KV heads per layer (the largest, if layers differ).
        head_dim: Width of a K or V head (the larger of the two).
        itemsize: Bytes per element of the KV dtype.
        context_window: The model's maximum positions, or None if it does not say.
        dtype: The KV's dtype, by name ("float32", "bfloat16", ...).
    """

    n_layers: int
    n_layers_total: int
    n_kv_heads: int
    head_dim: int
    itemsize: int
    context_window: int | None
    dtype: str = ""

    def bytes_per_block(self, block_size: int, codec: KVCodec | None = None) -> int:
        """Bytes behind one block: ``block_size`` slots of one layer's K (or V), one sequence,
        stored as ``codec`` says (None: the model's type)."""
        if codec is None:
            return block_size * self.n_kv_heads * self.head_dim * self.itemsize
        return block_size * self.n_kv_heads * codec.bytes_per_head_token(self.head_dim)


def probe_geometry(model: Any) -> KVGeometry:
    """Run one token through the model with stock caches and read the KV shapes (MLX thread)."""
    caches = make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    plain: list[Any] = [c for c in caches if type(c) is KVCache and c.keys is not None]
    mx.eval([c.state for c in plain])
    if not plain:
        raise ValueError("the model has no plain KV-cache layers for the pool to account")
    heads = max(c.keys.shape[1] for c in plain)
    dim = max(max(c.keys.shape[3], c.values.shape[3]) for c in plain)
    args = getattr(model, "args", None)
    window = getattr(args, "max_position_embeddings", None) if args is not None else None
    return KVGeometry(
        n_layers=len(plain),
        n_layers_total=len(caches),
        n_kv_heads=heads,
        head_dim=dim,
        itemsize=plain[0].keys.dtype.size,
        context_window=int(window) if window else None,
        dtype=str(plain[0].keys.dtype).rsplit(".", 1)[-1],
    )


def pool_config(
    geometry: KVGeometry,
    *,
    block_size: int,
    kv_cache_mb: float | None,
    n_blocks: int | None,
    separate_kv: bool,
    grow_on_exhaustion: bool,
    max_blocks: int | None,
    codec: KVCodec | None = None,
) -> PoolConfig:
    """A PoolConfig from an explicit block count, or from a KV budget in MiB and the geometry
    (blocks of ``codec``'s size: a quantized format fits more of them in the budget)."""
    if n_blocks is None:
        if kv_cache_mb is None:
            raise ValueError("give n_blocks or kv_cache_mb")
        n_blocks = int(kv_cache_mb * 2**20) // geometry.bytes_per_block(block_size, codec)
    return PoolConfig(
        block_size=block_size,
        n_blocks=n_blocks,
        separate_kv=separate_kv,
        grow_on_exhaustion=grow_on_exhaustion,
        max_blocks=max_blocks,
    )
