"""KV geometry of a loaded model, pool sizing from a memory budget, and admission arithmetic."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from veloxquant_mlx.pool import BlockPoolAllocator, PoolConfig


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
    """

    n_layers: int
    n_layers_total: int
    n_kv_heads: int
    head_dim: int
    itemsize: int
    context_window: int | None

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes behind one block: ``block_size`` slots of one layer's K (or V), one sequence."""
        return block_size * self.n_kv_heads * self.head_dim * self.itemsize


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
) -> PoolConfig:
    """A PoolConfig from an explicit block count, or from a KV budget in MiB and the geometry."""
    if n_blocks is None:
        if kv_cache_mb is None:
            raise ValueError("give n_blocks or kv_cache_mb")
        n_blocks = int(kv_cache_mb * 2**20) // geometry.bytes_per_block(block_size)
    return PoolConfig(
        block_size=block_size,
        n_blocks=n_blocks,
        separate_kv=separate_kv,
        grow_on_exhaustion=grow_on_exhaustion,
        max_blocks=max_blocks,
    )


class Admission:
    """How many blocks a set of requests may need at most, and whether the pool can hold them.

    A request whose prompt plus ``max_tokens`` is ``end`` tokens can make a batch row's buffers
    grow to ``end + step - 1`` slots (mlx_lm grows by whole ``step`` chunks), and batching pads
    every row to the longest, so a batch of R rows whose longest ``end`` is E needs at most
    ``R * n_layers * ceil((E + step - 1) / block_size)`` blocks per stream. Admission asks the
    pool for that bound up front, so growth never fails mid-request. Engine thread only.
    """

    def __init__(self, pool: BlockPoolAllocator, n_layers: int, step: int) -> None:
        self.pool = pool
        self.n_layers = n_layers
        self.step = step

    def row_blocks(self, end: int) -> int:
        """Blocks per stream one row of a batch whose longest request is ``end`` may hold."""
        return self.n_layers * math.ceil((end + self.step - 1) / self.pool.config.block_size)

    def need(self, ends: list[int]) -> int:
        """Blocks per stream the requests with these ``end``s may hold together."""
        return len(ends) * self.row_blocks(max(ends)) if ends else 0

    def fits(self, ends: list[int]) -> bool:
        """True if the pool, as it is now (plus allowed growth), can hold ``need(ends)``."""
        return self._fits(self.need(ends), current=True)

    def could_ever_fit(self, end: int) -> bool:
        """True if one request alone fits the pool at its maximum size (as it is now: an
        operator's shrink lowers it)."""
        return self._fits(self.need([end]), current=False)

    def fits_configured(self, end: int) -> bool:
        """True if one request alone fits the pool as configured (before any shrink)."""
        cfg = self.pool.config
        if cfg.separate_kv:
            totals = {"k": cfg.n_blocks - cfg.n_blocks // 2, "v": cfg.n_blocks // 2}
        else:
            totals = {"kv": cfg.n_blocks}
        return self._fits(self.need([end]), current=False, totals=totals)

    def _fits(self, need: int, *, current: bool, totals: dict[str, int] | None = None) -> bool:
        cfg = self.pool.config
        streams = ("k", "v") if cfg.separate_kv else ("kv",)
        per_stream_need = need if cfg.separate_kv else 2 * need
        if totals is None:
            totals = {s: self.pool.n_total(s) for s in streams}
        deficit = sum(max(0, per_stream_need - totals[s]) for s in streams)
        if not cfg.grow_on_exhaustion:
            return deficit == 0
        if cfg.max_blocks is None:
            return True
        headroom = cfg.max_blocks - (sum(totals.values()) if current else 0)
        if not current:
            deficit = per_stream_need * len(streams)
        return deficit <= headroom

    def retirable(self, stream: str, ends: list[int]) -> int:
        """Free blocks of ``stream`` that may be retired without breaking a promise."""
        need = self.need(ends) * (1 if self.pool.config.separate_kv else 2)
        total = self.pool.n_total(stream)
        return max(0, min(self.pool.n_free(stream), total - need))
