"""Block arithmetic: how many of the pool's blocks a request of n tokens takes, and whether one
ever fits. The one home of "blocks for n tokens"; no state but the pool it reads."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from veloxquant_mlx.pool import BlockPoolAllocator


@dataclass(frozen=True, slots=True)
class BlockMath:
    """A request of ``n`` tokens holds ``blocks_for(n)`` blocks per layer and stream: its K and
    V of every layer, ``2 * n_layers * blocks_for(n)`` blocks in all, on two free lists (K, V)
    or one shared. Thread-safe: it reads the pool only through its thread-safe methods.

    With several KV formats (``--kv-formats``) the blocks are sized for the smallest, and a
    page of ``block_size`` tokens in format ``f`` takes ``spans[f]`` blocks per layer and
    stream (its bytes over a block's, rounded up); ``""`` is the server's own format. A row
    of a quantized format with a residual window (``--kv-recent-tokens``) also holds
    ``windows[f]`` blocks of each stream while it runs.
    """

    pool: BlockPoolAllocator
    n_layers: int
    windows: Mapping[str, int] = field(default_factory=dict)  # a row's window, by format
    spans: Mapping[str, int] = field(default_factory=dict)  # blocks a page takes, by format

    def window(self, fmt: str = "") -> int:
        """Blocks of each stream a row of format ``fmt`` holds for its residual window."""
        return self.windows.get(fmt, 0)

    def span(self, fmt: str = "") -> int:
        """Blocks per layer and stream one page of format ``fmt`` takes (1 unless mixed)."""
        return self.spans.get(fmt, 1)

    @property
    def block_size(self) -> int:
        return self.pool.config.block_size

    @property
    def streams(self) -> tuple[str, ...]:
        """The pool's free lists: ("k", "v") or ("kv",)."""
        return ("k", "v") if self.pool.config.separate_kv else ("kv",)

    def blocks_for(self, n_tokens: int, fmt: str = "") -> int:
        """Blocks per layer and stream for ``n_tokens`` tokens in format ``fmt``. O(1)."""
        return -(-n_tokens // self.block_size) * self.span(fmt)

    def per_stream(self, per_call: int) -> int:
        """Blocks one ``allocate`` per stream (K, then V) of ``per_call`` blocks takes from each
        free list: ``per_call``, or twice that when K and V share one list."""
        return per_call if self.pool.config.separate_kv else 2 * per_call

    @property
    def per_page(self) -> int:
        """Blocks of one free list that one page (``block_size`` tokens, every layer) takes."""
        return self.per_stream(self.n_layers)

    @property
    def blocks_per_token_block(self) -> int:
        """Blocks of one pool stream that ``block_size`` tokens take: K or V of every layer
        (both, when K and V share one stream)."""
        return self.per_page

    def could_ever_fit(self, n_tokens: int, fmt: str = "") -> bool:
        """Whether one request of ``n_tokens`` tokens fits the pool alone, as it is now."""
        return self._fits(n_tokens, {s: self._max_total(s) for s in self.streams}, fmt)

    def fits_configured(self, n_tokens: int, fmt: str = "") -> bool:
        """Whether it fits the pool as configured (before any shrink)."""
        cfg = self.pool.config
        if cfg.separate_kv:
            totals = {"k": cfg.n_blocks - cfg.n_blocks // 2, "v": cfg.n_blocks // 2}
        else:
            totals = {"kv": cfg.n_blocks}
        return self._fits(n_tokens, totals, fmt)

    def _max_total(self, stream: str) -> int:
        cfg = self.pool.config
        total = self.pool.n_total(stream)
        if cfg.grow_on_exhaustion:
            if cfg.max_blocks is None:
                return 1 << 62
            return total + max(0, cfg.max_blocks - self.pool.stats.n_blocks)
        return total

    def _fits(self, n_tokens: int, totals: dict[str, int], fmt: str) -> bool:
        need = self.per_stream(self.n_layers * self.blocks_for(n_tokens, fmt) + self.window(fmt))
        return all(need <= t for t in totals.values())
