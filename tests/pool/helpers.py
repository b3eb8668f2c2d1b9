"""Factory helpers shared by the pool tests."""

from __future__ import annotations

from veloxquant_mlx.pool import BlockPoolAllocator, PoolConfig


def make_pool(
    n_blocks: int = 8,
    block_size: int = 4,
    *,
    separate_kv: bool = True,
    grow: bool = False,
    max_blocks: int | None = None,
) -> BlockPoolAllocator:
    return BlockPoolAllocator(
        PoolConfig(
            block_size=block_size,
            n_blocks=n_blocks,
            separate_kv=separate_kv,
            grow_on_exhaustion=grow,
            max_blocks=max_blocks,
        )
    )


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]
