"""PoolBackedKVCache against mlx_lm's stock KVCache, step by step, with the pool checked."""

import math

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from tests.support.models import ARCHS, tiny_model
from veloxquant_mlx.cache.pool_backed import register_with_mlx_lm
from veloxquant_mlx.memory import BlockPoolExhaustedError, PoolBackedKVCache, build_pooled_caches

H, D = 2, 8


def kv(n: int, seed: int, batch: int = 1):
    mx.random.seed(seed)
    return mx.random.normal((batch, H, n, D)), mx.random.normal((batch, H, n, D))


def expected_blocks(cache: PoolBackedKVCache, block_size: int) -> int:
    if cache.keys is None:
        return 0
    return 2 * cache.keys.shape[0] * math.ceil(cache.keys.shape[2] / block_size)


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape and mx.array_equal(x, y).item()


def test_bit_identical_to_stock_through_growth_trim_and_state(make_pool):
    pool = make_pool(block_size=16, n_blocks=4096)
    ours, stock = PoolBackedKVCache(pool, owner=1), KVCache()
    steps = [300] + [1] * 250 + [40] + [1] * 30
    for i, n in enumerate(steps):
        k, v = kv(n, seed=i)
        assert_same(ours.update_and_fetch(k, v), stock.update_and_fetch(k, v))
        assert ours.offset == stock.offset and ours.size() == stock.size()
        assert pool.n_blocks_for(1) == expected_blocks(ours, 16)
        if i == 100:
            assert ours.trim(7) == stock.trim(7) == 7
        if i == 200:
            # state round trip: ours takes back what it gives; stock's 3-tuple too
            ours.state = ours.state
            stock_state = stock.state
            stock.state = (
                stock_state[0][..., : stock.offset, :],
                stock_state[1][..., : stock.offset, :],
                stock.offset,
            )
            assert pool.n_blocks_for(1) == expected_blocks(ours, 16)
    assert ours.nbytes == stock.nbytes
    ours.release()
    assert pool.n_blocks_for(1) == 0


def test_default_step_is_max_of_block_size_and_256(make_pool):
    assert PoolBackedKVCache(make_pool(block_size=16)).step == 256
    assert PoolBackedKVCache(make_pool(block_size=512)).step == 512
    assert PoolBackedKVCache(make_pool(block_size=16), step=32).step == 32
    with pytest.raises(ValueError):
        PoolBackedKVCache(make_pool(), step=0)


def test_growth_accounts_whole_chunks_per_row(make_pool):
    pool = make_pool(block_size=16, n_blocks=1024)
    cache = PoolBackedKVCache(pool, owner=5, step=64)
    cache.update_and_fetch(*kv(1, 0, batch=3))
    # 3 rows x 64 slots = 3 x 4 blocks, for K and for V
    assert pool.n_blocks_for(5) == 24 and cache.n_blocks_held() == 24
    assert pool.n_free("k") == 512 - 12 and pool.n_free("v") == 512 - 12
    cache.release()


def test_refused_growth_changes_nothing(make_pool):
    pool = make_pool(block_size=16, n_blocks=32)  # 16 K + 16 V blocks = 256 slots each
    cache = PoolBackedKVCache(pool, owner=1)
    cache.update_and_fetch(*kv(250, 0))
    keys_before = cache.keys
    with pytest.raises(BlockPoolExhaustedError):
        cache.update_and_fetch(*kv(10, 1))
    assert cache.offset == 250 and cache.keys is keys_before
    assert pool.n_blocks_for(1) == 32
    cache.release()


def test_k_and_v_growth_is_all_or_nothing(make_pool):
    pool = make_pool(block_size=16, n_blocks=32)
    hog = pool.allocate("v", 16, owner="hog")  # V has one block fewer than K
    cache = PoolBackedKVCache(pool, owner=1)
    with pytest.raises(BlockPoolExhaustedError):
        cache.update_and_fetch(*kv(1, 0))
    assert pool.n_blocks_for(1) == 0 and pool.n_free("k") == 16
    pool.free(hog)


def test_release_is_idempotent_and_frees_every_layer(make_pool):
    pool = make_pool(block_size=16, n_blocks=1024)
    model = tiny_model("llama", layers=4)
    caches = build_pooled_caches(model, pool, owner=9)
    assert len(caches) == 4 and all(isinstance(c, PoolBackedKVCache) for c in caches)
    for c in caches:
        c.update_and_fetch(*kv(20, 0))
    assert pool.n_blocks_for(9) == 4 * 2 * 16
    caches[2].release()
    caches[2].release()
    assert pool.n_blocks_for(9) == 0
    assert all(c.empty() and c.n_blocks_held() == 0 for c in caches)


def test_protocol_methods_match_stock(make_pool):
    pool = make_pool(block_size=16, n_blocks=256)
    ours, stock = PoolBackedKVCache(pool, owner=1), KVCache()
    assert ours.empty() and ours.nbytes == 0 and ours.size() == 0 and ours.state == ()
    assert ours.meta_state == "" and ours.is_trimmable()
    for c in (ours, stock):
        c.update_and_fetch(*kv(10, 3))
    assert not ours.empty()
    for n in (1, 5):
        for ra, ws in ((False, None), (True, None), (False, 4)):
            a = ours.make_mask(n, return_array=ra, window_size=ws)
            b = stock.make_mask(n, return_array=ra, window_size=ws)
            assert (
                (a is None and b is None)
                or (isinstance(a, str) and a == b)
                or mx.array_equal(a, b).item()
            )
    assert ours.trim(100) == 10 and ours.size() == 0
    assert ours.trim(-3) == 0
    ours.release()


def test_state_setter_validates_and_reaccounts(make_pool):
    pool = make_pool(block_size=16, n_blocks=256)
    cache = PoolBackedKVCache(pool, owner=1)
    k, v = kv(40, 0)
    cache.state = (k, v)
    assert cache.offset == 40 and pool.n_blocks_for(1) == 2 * 3
    cache.state = (k, v, 33)
    assert cache.offset == 33
    with pytest.raises(ValueError):
        cache.state = (k, v, 41)
    with pytest.raises(ValueError):
        cache.state = (k,)
    cache.state = None
    assert cache.empty() and pool.n_blocks_for(1) == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_stock_caches(arch, make_pool):
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    model = tiny_model(arch)
    prompt = mx.array([1, 5, 9, 3, 7, 2, 8, 11, 4, 6, 10, 12])

    def run(cache):
        gen = generate_step(prompt, model, prompt_cache=cache, max_tokens=280)
        return [int(tok) for tok, _ in gen]

    pool = make_pool(block_size=16, n_blocks=4096)
    caches = build_pooled_caches(model, pool, owner=1)
    assert run(caches) == run(make_prompt_cache(model))
    pooled = [c for c in caches if isinstance(c, PoolBackedKVCache)]
    # 292 tokens -> 512-slot buffers -> 32 blocks per stream per pooled layer
    assert pool.n_blocks_for(1) == len(pooled) * 2 * 32
    if arch == "llama_sliding":
        assert len(pooled) == 1  # the sliding layer keeps mlx_lm's RotatingKVCache (fallback)
    caches[-1].release()


def test_generate_and_stream_generate_with_the_default_model(default_model, make_pool):
    import mlx_lm

    model, tokenizer = default_model
    pool = make_pool(block_size=16, n_blocks=2048)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello world"}], add_generation_prompt=True
    )
    stock = mlx_lm.generate(model, tokenizer, prompt, max_tokens=40)
    caches = build_pooled_caches(model, pool, owner=3)
    assert mlx_lm.generate(model, tokenizer, prompt, max_tokens=40, prompt_cache=caches) == stock
    caches[0].release()
    caches = build_pooled_caches(model, pool, owner=4)
    text = "".join(
        r.text for r in mlx_lm.stream_generate(model, tokenizer, prompt, 40, prompt_cache=caches)
    )
    assert text == stock
    caches[0].release()


def test_save_and_load_prompt_cache_round_trip(tmp_path, make_pool):
    pool = make_pool(block_size=16, n_blocks=256)
    caches = [PoolBackedKVCache(pool, owner=1) for _ in range(2)]
    for i, c in enumerate(caches):
        c.update_and_fetch(*kv(37, i))
    path = str(tmp_path / "cache.safetensors")
    register_with_mlx_lm()  # load_prompt_cache finds the class by name in mlx_lm's module
    save_prompt_cache(path, caches, {"who": "test"})
    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"who": "test"}
    for a, b in zip(caches, loaded, strict=True):
        assert isinstance(b, PoolBackedKVCache) and b.offset == 37
        assert_same(a.state, b.state)
        b.attach(pool, owner=2)
    assert pool.n_blocks_for(2) == 2 * 2 * 3
    pool.free_all(2)
    caches[0].release()


def test_merge_returns_a_pool_accounted_batch(make_pool):
    from veloxquant_mlx.cache.pool_backed_batch import PoolBackedBatchKVCache

    pool = make_pool(block_size=16, n_blocks=1024)
    singles = [PoolBackedKVCache(pool, owner=i) for i in range(3)]
    for i, (c, n) in enumerate(zip(singles, (5, 40, 0), strict=True)):
        if n:
            c.update_and_fetch(*kv(n, i))
    batch = PoolBackedKVCache.merge(singles)
    assert isinstance(batch, PoolBackedBatchKVCache)
    assert batch.owners == [0, 1, 2]
    # merged buffer is 3 rows x 40 slots: each row owns ceil(40/16) = 3 blocks per stream,
    # padding included; the singles gave their blocks up
    assert [pool.n_blocks_for(i) for i in range(3)] == [6, 6, 6]
    assert all(c.n_blocks_held() == 0 for c in singles)
    batch.release()
