"""MLXBlockStorage: the mx.array buffers behind a pool's block ids."""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.pool import Block, BlockPoolAllocator

# format -> (bits per element, or 0 for a float dtype; float dtype)
_FLOAT_FORMATS = {"fp16": mx.float16, "bf16": mx.bfloat16, "fp32": mx.float32}
_INT_BITS = {"int8": 8, "int4": 4, "int2": 2, "int1": 1}


class MLXBlockStorage:
    """Backing array storage for a BlockPoolAllocator: one buffer per block id.

    Each buffer holds ``block_size`` rows of ``head_dim`` elements in the block's format and is
    created on first use, then reused in place whenever the pool hands the block id out again
    (writing overwrites; no new allocation in steady state). Formats can differ block by block
    in one pool: float formats ("fp16", "bf16", "fp32") store values; integer formats store
    codes bit-packed into uint32 words ("int8": 4 codes a word, "int4": 8, "int2": 16,
    "int1": 32; ``head_dim * bits`` must be a multiple of 32). A buffer is re-created only when
    its block id is reused with another format. Buffers of blocks the pool has retired
    (``shrink``) are dropped by ``resident_bytes()`` / ``drop_retired()``.

    Owns: the buffers, keyed by block id. Not thread-safe: use it from the thread that runs MLX.

    Args:
        pool: The allocator whose block ids index this storage.
        head_dim: Width of each stored row.
    """

    def __init__(self, pool: BlockPoolAllocator, head_dim: int) -> None:
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
            raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
        self.pool = pool
        self.head_dim = head_dim
        self._buffers: dict[int, tuple[str, mx.array]] = {}

    def _shape_dtype(self, format: str) -> tuple[tuple[int, int], mx.Dtype]:
        block_size = self.pool.config.block_size
        if format in _FLOAT_FORMATS:
            return (block_size, self.head_dim), _FLOAT_FORMATS[format]
        bits = _INT_BITS.get(format)
        if bits is None:
            known = ", ".join([*_FLOAT_FORMATS, *_INT_BITS])
            raise ValueError(f"unsupported block format {format!r}; known: {known}")
        if (self.head_dim * bits) % 32:
            raise ValueError(f"{format} needs head_dim * {bits} divisible by 32")
        return (block_size, self.head_dim * bits // 32), mx.uint32

    def buffer_for(self, block: Block) -> mx.array:
        """The buffer backing ``block`` (created on first use, or when its format changed).

        Returns:
            ``(block_size, head_dim)`` for float formats, ``(block_size, head_dim*bits/32)``
            uint32 words for integer formats.

        Raises:
            ValueError: For an unsupported format, or a block that is not live in the pool.
        """
        entry = self._buffers.get(block.block_id)
        if entry is not None and entry[0] == block.format:
            return entry[1]
        if not self.pool.is_live(block.block_id):
            raise ValueError(f"block {block.block_id} is not live in the pool")
        shape, dtype = self._shape_dtype(block.format)
        buffer = mx.zeros(shape, dtype=dtype)
        self._buffers[block.block_id] = (block.format, buffer)
        return buffer

    def write(self, block: Block, offset: int, values: mx.array) -> None:
        """Write rows ``values`` (n, head_dim) into ``block`` at token slot ``offset``.

        Float formats take values (cast to the block's dtype); integer formats take codes in
        ``[0, 2**bits)``, which are packed.

        Raises:
            ValueError: On a shape mismatch, rows past the block's end, or codes out of range.
        """
        buffer = self.buffer_for(block)
        if values.ndim != 2 or values.shape[1] != self.head_dim:
            raise ValueError(f"values must be (n, {self.head_dim}), got {values.shape}")
        n = values.shape[0]
        if offset < 0 or offset + n > self.pool.config.block_size:
            raise ValueError(
                f"{n} rows at offset {offset} do not fit a block of {self.pool.config.block_size}"
            )
        if block.format in _FLOAT_FORMATS:
            buffer[offset : offset + n] = values.astype(buffer.dtype)
        else:
            buffer[offset : offset + n] = _pack(values, _INT_BITS[block.format])

    def read(self, block: Block, n_rows: int | None = None) -> mx.array:
        """The first ``n_rows`` rows of ``block`` (default ``block.n_used``), unpacked.

        Returns:
            Float rows for float formats, uint8 codes for integer formats.
        """
        buffer = self.buffer_for(block)
        n = block.n_used if n_rows is None else n_rows
        rows = buffer[:n]
        if block.format in _FLOAT_FORMATS:
            return rows
        return _unpack(rows, _INT_BITS[block.format], self.head_dim)

    def resident_bytes(self) -> int:
        """Bytes of every buffer held, after dropping those of retired blocks."""
        self.drop_retired()
        return sum(buffer.nbytes for _, buffer in self._buffers.values())

    def drop_retired(self) -> int:
        """Drop buffers whose block ids the pool has retired; returns how many. O(buffers)."""
        dead = [block_id for block_id in self._buffers if not self.pool.is_live(block_id)]
        for block_id in dead:
            del self._buffers[block_id]
        return len(dead)

    def release(self, block: Block | None = None) -> None:
        """Drop ``block``'s buffer (or every buffer) so MLX can reclaim the memory.

        Without this a freed block's buffer is kept and reused when the id is handed out again.
        """
        if block is None:
            self._buffers.clear()
        else:
            self._buffers.pop(block.block_id, None)


def _pack(codes: mx.array, bits: int) -> mx.array:
    per_word = 32 // bits
    if codes.size and (int(mx.min(codes)) < 0 or int(mx.max(codes)) >= 1 << bits):
        raise ValueError(f"codes must be in [0, {1 << bits})")
    n, d = codes.shape
    grouped = codes.astype(mx.uint32).reshape(n, d // per_word, per_word)
    shifts = (mx.arange(per_word, dtype=mx.uint32) * bits)[None, None, :]
    return mx.sum(grouped << shifts, axis=-1).astype(mx.uint32)


def _unpack(words: mx.array, bits: int, head_dim: int) -> mx.array:
    per_word = 32 // bits
    shifts = (mx.arange(per_word, dtype=mx.uint32) * bits)[None, None, :]
    mask = mx.array((1 << bits) - 1, dtype=mx.uint32)
    codes = (words[:, :, None] >> shifts) & mask
    return codes.reshape(words.shape[0], head_dim).astype(mx.uint8)
