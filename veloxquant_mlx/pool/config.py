"""Pool sizing and behaviour."""

from __future__ import annotations

from dataclasses import dataclass


def _require_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"PoolConfig.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"PoolConfig.{name} must be >= {minimum}, got {value}")


@dataclass(slots=True)
class PoolConfig:
    """Configuration for a :class:`BlockPoolAllocator`.

    Attributes:
        block_size: Number of token slots stored per block (>= 1).
        n_blocks: Total number of blocks the pool manages initially (>= 0). With
            ``separate_kv=True`` they are split between the "k" and "v" free lists, "k" taking
            the odd one out (``n_blocks=5`` gives 3 K blocks and 2 V blocks), so
            ``AllocationStats.n_blocks`` always equals ``n_blocks`` at construction.
        separate_kv: If True, keys and values are allocated from independent free lists (K and V
            blocks are never interchanged). If False, a single free list backs both keys and
            values, which packs tighter when K and V pressure is uneven across requests.
        grow_on_exhaustion: If True, an allocate() call that would otherwise raise
            BlockPoolExhaustedError instead grows the exhausted stream's block count just enough
            to satisfy the request (see max_blocks). If False (default), exhaustion always raises.
        max_blocks: Upper bound on total blocks across all streams once grown (blocks retired by
            shrink() no longer count). None means unbounded growth. Ignored when
            grow_on_exhaustion is False. Growth that would exceed this cap still raises
            BlockPoolExhaustedError, and then nothing grows (growth is all-or-nothing too).

    Raises:
        ValueError: On construction, for a non-int or out-of-range field, or for
            ``grow_on_exhaustion=True`` with ``max_blocks < n_blocks``.
    """

    block_size: int = 16
    n_blocks: int = 1024
    separate_kv: bool = True
    grow_on_exhaustion: bool = False
    max_blocks: int | None = None

    def __post_init__(self) -> None:
        _require_int("block_size", self.block_size, 1)
        _require_int("n_blocks", self.n_blocks, 0)
        if self.max_blocks is not None:
            _require_int("max_blocks", self.max_blocks, 0)
            if self.grow_on_exhaustion and self.max_blocks < self.n_blocks:
                raise ValueError(
                    f"PoolConfig.max_blocks ({self.max_blocks}) must be >= n_blocks "
                    f"({self.n_blocks}) when grow_on_exhaustion is True"
                )
