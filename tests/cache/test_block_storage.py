"""MLXBlockStorage: one buffer per block id, reused in place, mixed formats in one pool."""

import mlx.core as mx
import pytest

from veloxquant_mlx.memory import MLXBlockStorage


def codes(n, d, bits, seed=0):
    mx.random.seed(seed)
    return mx.random.randint(0, 1 << bits, (n, d)).astype(mx.uint8)


def test_buffers_are_reused_in_place_across_requests(make_pool):
    pool = make_pool(block_size=16, n_blocks=8)
    storage = MLXBlockStorage(pool, head_dim=64)
    (block,) = pool.allocate("k", 16, owner=1)
    buffer = storage.buffer_for(block)
    storage.write(block, 0, mx.ones((16, 64)))
    pool.free_all(1)
    (again,) = pool.allocate("k", 16, owner=2)
    assert again is block and storage.buffer_for(again) is buffer
    storage.write(again, 0, mx.full((16, 64), 2.0))
    assert mx.all(storage.read(again) == 2).item()
    pool.free_all(2)


@pytest.mark.parametrize(("fmt", "bits"), [("int8", 8), ("int4", 4), ("int2", 2), ("int1", 1)])
def test_integer_formats_are_bit_packed_and_round_trip(make_pool, fmt, bits):
    pool = make_pool(block_size=16, n_blocks=4)
    storage = MLXBlockStorage(pool, head_dim=64)
    (block,) = pool.allocate("k", 10, owner=1, format=fmt)
    data = codes(10, 64, bits)
    storage.write(block, 0, data)
    assert storage.buffer_for(block).nbytes == 16 * 64 * bits // 8
    assert mx.array_equal(storage.read(block), data).item()
    with pytest.raises(ValueError):
        storage.write(block, 0, data.astype(mx.int32) + (1 << bits))
    pool.free_all(1)


def test_mixed_formats_share_one_pool(make_pool):
    pool = make_pool(block_size=8, n_blocks=8)
    storage = MLXBlockStorage(pool, head_dim=32)
    fp = pool.allocate("k", 8, owner=1, format="fp16")[0]
    q4 = pool.allocate("k", 8, owner=2, format="int4")[0]
    q2 = pool.allocate("v", 8, owner=2, format="int2")[0]
    storage.write(fp, 0, mx.ones((8, 32)))
    storage.write(q4, 0, codes(8, 32, 4))
    storage.write(q2, 0, codes(8, 32, 2))
    assert storage.resident_bytes() == 8 * 32 * 2 + 8 * 32 // 2 + 8 * 32 // 4
    pool.free_all(1)
    # block id reused with another format: its buffer is re-made in that format
    reused = pool.allocate("k", 8, owner=3, format="int8")[0]
    assert reused is fp and storage.buffer_for(reused).dtype == mx.uint32
    pool.free_all(2)
    pool.free_all(3)


def test_shrink_drops_retired_buffers(make_pool):
    pool = make_pool(block_size=8, n_blocks=8)
    storage = MLXBlockStorage(pool, head_dim=32)
    blocks = pool.allocate("k", 32, owner=1)
    for b in blocks:
        storage.write(b, 0, mx.ones((8, 32)))
    assert storage.resident_bytes() == 4 * 8 * 32 * 2
    pool.free_all(1)
    assert pool.shrink("k", 1) == 3
    assert storage.resident_bytes() == 8 * 32 * 2
    storage.release()
    assert storage.resident_bytes() == 0


def test_bad_writes_and_formats_raise(make_pool):
    pool = make_pool(block_size=8, n_blocks=4)
    storage = MLXBlockStorage(pool, head_dim=32)
    (block,) = pool.allocate("k", 8, owner=1, format="fp8")
    with pytest.raises(ValueError):
        storage.buffer_for(block)
    pool.free_all(1)
    (block,) = pool.allocate("k", 8, owner=1)
    with pytest.raises(ValueError):
        storage.write(block, 4, mx.ones((5, 32)))
    with pytest.raises(ValueError):
        storage.write(block, 0, mx.ones((2, 31)))
    with pytest.raises(ValueError):
        MLXBlockStorage(pool, head_dim=0)
    pool.free_all(1)
