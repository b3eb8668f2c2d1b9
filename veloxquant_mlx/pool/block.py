"""The block record the pool hands out."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    """A single fixed-size block of KV-cache storage.

    The pool keeps one ``Block`` per block id for the id's whole life and hands that same object
    out on every allocation, so a caller's reference stays valid while it owns the block. Only the
    pool writes its fields (``n_used`` through :meth:`BlockPoolAllocator.mark_used`); a reference
    kept after the block is freed sees the next owner's state. Blocks compare by value (a
    dataclass); the pool itself tells its blocks apart by ``block_id`` and identity.

    Attributes:
        block_id: Index into the pool's backing storage; stable for the lifetime of the pool
            (blocks are reused in place, never moved).
        stream: Which logical stream ("k" or "v") this block belongs to. Always "kv" when the
            owning pool was built with separate_kv=False.
        format: Compression-format tag of the data currently stored in this block (e.g. "fp16",
            "int2", "int4"). Lets a single pool host blocks written by different quantization
            methods concurrently. A freed block keeps the tag of its last owner until reused.
        n_used: Number of token slots currently occupied (<= block_size). 0 while free.
        owner: Opaque request id the block is currently checked out to, or None if the block is
            free.
        ever_allocated: True once this block id has been handed out by
            BlockPoolAllocator.allocate() at least once. Used to distinguish a fresh allocation
            from a reuse for stats purposes.
    """

    block_id: int
    stream: str = "kv"
    format: str = "fp16"
    n_used: int = 0
    owner: int | None = None
    ever_allocated: bool = False
