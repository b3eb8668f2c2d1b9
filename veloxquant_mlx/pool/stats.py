"""Running counters of a block pool and their Prometheus rendering."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

_METRIC_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


@dataclass(slots=True)
class AllocationStats:
    """Running counters for a BlockPoolAllocator.

    All counts are cumulative since pool construction unless noted. Where the seed leaves the
    unit open, the words decide: ``n_allocations`` and ``n_exhausted`` count allocate() calls,
    ``n_frees`` counts free() calls plus free_all() calls that returned at least one block, and
    ``n_reused``, ``n_grown``, ``n_retired`` and ``peak_blocks_in_use`` count blocks.

    A pool's live object is mutated under the pool's lock; what the pool hands out
    (``BlockPoolAllocator.stats``, ``history``) is always a :meth:`snapshot`.

    Attributes:
        n_blocks: Total blocks managed by the pool (now, not cumulative).
        n_allocations: Number of successful allocate() calls.
        n_frees: Number of free() calls (and of free_all() calls that freed any block).
        n_reused: Allocations satisfied by a block that had previously been freed and returned
            to the pool (as opposed to a block that had never been handed out before); counted
            per block.
        n_exhausted: Allocation attempts that failed because no free block was available.
        n_grown: Number of blocks added to the pool by exhaustion-triggered growth (see
            PoolConfig.grow_on_exhaustion).
        n_retired: Number of blocks permanently removed from the pool by shrink() (see
            BlockPoolAllocator.shrink).
        peak_blocks_in_use: High-water mark of concurrently allocated blocks.
    """

    n_blocks: int
    n_allocations: int = 0
    n_frees: int = 0
    n_reused: int = 0
    n_exhausted: int = 0
    n_grown: int = 0
    n_retired: int = 0
    peak_blocks_in_use: int = 0
    _fragmented_count: int = field(default=0, repr=False)
    # Not in the seed's field list: blocks_in_use() cannot be derived from call counters, and
    # operators want free blocks per stream. Both are kept by the pool like the counters above.
    _blocks_in_use: int = field(default=0, repr=False)
    _free_by_stream: dict[str, int] = field(default_factory=dict, repr=False)

    def blocks_in_use(self) -> int:
        """Current number of allocated (non-free) blocks. O(1)."""
        return self._blocks_in_use

    def fragmentation(self) -> float:
        """Fraction of managed blocks that are neither free nor fully used.

        A block counts as fragmented once it has been allocated (n_used > 0) but is not full;
        a checked-out block whose fill level was set to 0 by mark_used() is not counted. Returns
        0.0 for an allocator with no blocks. O(1): the count is kept incrementally.
        """
        if self.n_blocks == 0:
            return 0.0
        return self._fragmented_count / self.n_blocks

    def snapshot(self) -> AllocationStats:
        """Return an independent copy of this stats object for history/export."""
        return replace(self, _free_by_stream=dict(self._free_by_stream))

    def to_prometheus(self, prefix: str = "veloxquant_block_pool") -> str:
        """Render these stats as Prometheus text-exposition-format gauges/counters.

        Every family has ``# HELP`` and ``# TYPE`` lines; counters end in ``_total`` and gauges
        do not; free blocks are one gauge with a ``stream`` label ("k" and "v", or "kv" for a
        shared free list). The text parses with ``prometheus_client.parser``.

        Args:
            prefix: Metric name prefix; must be a valid metric name without colons.

        Returns:
            Newline-terminated text in the Prometheus exposition format, suitable for serving
            directly from a /metrics endpoint or appending to a scrape response.

        Raises:
            ValueError: If ``prefix`` is not a valid Prometheus metric name (or has a colon,
                which is reserved for recording rules).
        """
        if not isinstance(prefix, str) or not _METRIC_NAME.match(prefix):
            raise ValueError(f"prefix must match [a-zA-Z_][a-zA-Z0-9_]*, got {prefix!r}")
        out: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            full = f"{prefix}_{name}"
            out.append(f"# HELP {full} {help_text}")
            out.append(f"# TYPE {full} {kind}")
            out.extend(f"{full}{labels} {_format_value(value)}" for labels, value in samples)

        family("blocks", "gauge", "Blocks managed by the pool.", [("", self.n_blocks)])
        family(
            "blocks_in_use",
            "gauge",
            "Blocks currently checked out to an owner.",
            [("", self.blocks_in_use())],
        )
        family(
            "blocks_free",
            "gauge",
            "Blocks on the free list, by stream.",
            [(f'{{stream="{s}"}}', n) for s, n in sorted(self._free_by_stream.items())],
        )
        family(
            "peak_blocks_in_use",
            "gauge",
            "High-water mark of blocks checked out at once.",
            [("", self.peak_blocks_in_use)],
        )
        family(
            "fragmentation_ratio",
            "gauge",
            "Fraction of managed blocks checked out but not full (0-1).",
            [("", self.fragmentation())],
        )
        family(
            "allocations_total",
            "counter",
            "Successful allocate() calls.",
            [("", self.n_allocations)],
        )
        family("frees_total", "counter", "free() and free_all() calls.", [("", self.n_frees)])
        family(
            "reused_blocks_total",
            "counter",
            "Blocks handed out again after having been freed.",
            [("", self.n_reused)],
        )
        family(
            "exhausted_total",
            "counter",
            "allocate() calls that failed for lack of free blocks.",
            [("", self.n_exhausted)],
        )
        family(
            "grown_blocks_total",
            "counter",
            "Blocks added by exhaustion-triggered growth.",
            [("", self.n_grown)],
        )
        family(
            "retired_blocks_total",
            "counter",
            "Blocks permanently removed by shrink().",
            [("", self.n_retired)],
        )
        return "\n".join(out) + "\n"


def _format_value(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    return repr(float(value))
