"""Per-owner records of the pool (used under the pool's lock only)."""

from __future__ import annotations

from veloxquant_mlx.pool.block import Block


class Owned:
    """One active owner's blocks (block id -> block, in allocation order: a dict, so that a
    partial free or a transfer costs the blocks it moves, not the blocks the owner holds; the
    prefix cache's owner holds most of a full pool) and how many are fragmented."""

    __slots__ = ("blocks", "n_fragmented")

    def __init__(self) -> None:
        self.blocks: dict[int, Block] = {}
        self.n_fragmented = 0


def check_owner(owner: object) -> None:
    if owner is None:
        raise ValueError("owner must not be None (None marks a free block)")
    try:
        hash(owner)
    except TypeError:
        raise ValueError(f"owner must be hashable, got {type(owner).__name__}") from None
