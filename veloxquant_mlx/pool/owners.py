"""Per-owner records of the pool (used under the pool's lock only)."""

from __future__ import annotations

from veloxquant_mlx.pool.block import Block


class Owned:
    """One active owner's blocks (a list in allocation order) and how many are fragmented."""

    __slots__ = ("blocks", "n_fragmented")

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.n_fragmented = 0


def check_owner(owner: object) -> None:
    if owner is None:
        raise ValueError("owner must not be None (None marks a free block)")
    try:
        hash(owner)
    except TypeError:
        raise ValueError(f"owner must be hashable, got {type(owner).__name__}") from None
