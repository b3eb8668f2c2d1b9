"""The minimal list-based allocator the pool is measured against: no stats, no history, no checks.

It keeps what any thread-safe block allocator must (one lock, a LIFO free list per stream, each
owner's blocks, the Block records it hands out) and nothing else.
"""

from __future__ import annotations

import threading

from veloxquant_mlx.pool import Block


class ReferencePool:
    def __init__(self, block_size: int, n_blocks: int) -> None:
        self.block_size = block_size
        self.lock = threading.Lock()
        half = n_blocks // 2
        self.free = {
            "k": [Block(i, "k") for i in range(n_blocks - half)],
            "v": [Block(i, "v") for i in range(n_blocks - half, n_blocks)],
        }
        self.owned: dict[int, list[Block]] = {}

    def allocate(self, stream: str, n_tokens: int, owner: int) -> list[Block]:
        n = -(-n_tokens // self.block_size)
        with self.lock:
            free = self.free[stream]
            if len(free) < n:
                raise RuntimeError("exhausted")
            taken = free[-n:]
            del free[-n:]
            for block in taken:
                block.owner = owner
                block.n_used = self.block_size
            self.owned.setdefault(owner, []).extend(taken)
            return taken

    def free_all(self, owner: int) -> None:
        with self.lock:
            for block in self.owned.pop(owner, ()):
                block.owner = None
                block.n_used = 0
                self.free[block.stream].append(block)
