"""VeloxQuant's compressed caches: accuracy against exact attention, memory against fp16."""

import math

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.cache.veloxquant import KVCache, KVCacheFactory

D = 128
# relative L2 error of attend() against exact fp32 attention, on keys with a few outlier
# channels and a peaked query (as real attention is), per method
# (a peaked query makes this close to one token's value: 2-bit values cost ~40% there)
ERROR_BOUNDS = {"fp16": 2e-3, "int8": 2e-2, "int4": 0.15, "kivi": 0.5}


def realistic_kv(n: int, seed: int = 0):
    mx.random.seed(seed)
    keys = mx.random.normal((n, D))
    keys = keys + mx.zeros((n, D)).at[:, :4].add(6.0)  # outlier channels, as in real keys
    values = mx.random.normal((n, D))
    query = keys[n // 3] * 0.5 + mx.random.normal((D,)) * 0.1
    return keys.astype(mx.float16), values.astype(mx.float16), query.astype(mx.float16)


def exact_attention(keys, values, q):
    k, v, q = (x.astype(mx.float32) for x in (keys, values, q))
    weights = mx.softmax((k @ q) / math.sqrt(D), axis=-1)
    return weights @ v


@pytest.mark.parametrize("method", sorted(ERROR_BOUNDS))
def test_attend_is_close_to_exact_attention(method):
    keys, values, q = realistic_kv(700)
    cache = KVCacheBuilder().with_method(method).with_head_dim(D).build()
    for i in range(0, 700, 50):  # runs and single tokens both work
        cache.append(keys[i : i + 49], values[i : i + 49])
        cache.append(keys[i + 49], values[i + 49])
    assert len(cache) == 700
    out = cache.attend(q)
    assert out.dtype == mx.float16 and out.shape == (D,)
    ref = exact_attention(keys, values, q)
    err = (mx.linalg.norm(out.astype(mx.float32) - ref) / mx.linalg.norm(ref)).item()
    assert err < ERROR_BOUNDS[method], f"{method}: relative error {err:.4f}"


def test_kivi_is_near_exact_when_attention_falls_on_the_fp16_window():
    keys, values, _ = realistic_kv(700)
    q = (keys[650].astype(mx.float32) * 2.0).astype(mx.float16)  # sharply on a recent token
    cache = KVCacheBuilder().with_method("kivi").with_head_dim(D).build()
    cache.append(keys, values)
    ref = exact_attention(keys, values, q)
    err = (mx.linalg.norm(cache.attend(q).astype(mx.float32) - ref) / mx.linalg.norm(ref)).item()
    assert err < 0.05


def test_memory_against_fp16_at_long_length():
    keys, values, _ = realistic_kv(4096)
    sizes = {}
    for method in ("fp16", "int8", "int4", "kivi"):
        cache = KVCacheBuilder().with_method(method).with_head_dim(D).build()
        cache.append(keys, values)
        sizes[method] = cache.memory_bytes()
    assert sizes["fp16"] == 2 * 4096 * D * 2
    assert sizes["fp16"] / sizes["int8"] > 1.7
    assert sizes["fp16"] / sizes["int4"] > 3.0
    assert sizes["fp16"] / sizes["kivi"] > 4.0  # genuinely packed 2-bit, fp16 window of 128


def test_kivi_keeps_the_most_recent_tokens_exact():
    keys, values, _ = realistic_kv(300)
    cache = KVCacheBuilder().with_method("kivi").with_head_dim(D).build()
    cache.append(keys, values)
    assert mx.array_equal(cache.keys()[-128:], keys[-128:].astype(mx.float32)).item()
    assert mx.array_equal(cache.values()[-128:], values[-128:].astype(mx.float32)).item()
    assert not mx.array_equal(cache.keys()[:32], keys[:32].astype(mx.float32)).item()


def test_reset_and_len():
    cache = KVCacheBuilder().with_method("int4").with_head_dim(64).build()
    keys, values = mx.ones((3, 64)), mx.ones((3, 64))
    cache.append_key(keys)
    assert len(cache) == 0 and cache.n_keys() == 3
    cache.append_value(values)
    assert len(cache) == 3
    cache.reset()
    assert len(cache) == 0 and cache.memory_bytes() == 0
    with pytest.raises(ValueError):
        cache.attend(mx.ones((64,)))


@pytest.mark.parametrize(
    "settings",
    [
        {"method": "nope"},
        {"method": "int4", "head_dim": 48},
        {"method": "kivi", "group_size": 16},
        {"head_dim": 0},
        {"head_dim": 2.0},
        {"residual_length": -1},
    ],
)
def test_bad_settings_raise_clear_errors(settings):
    with pytest.raises(ValueError):
        KVCacheConfig(**settings)


def test_unknown_method_error_names_the_known_ones():
    with pytest.raises(ValueError, match="fp16, int4, int8, kivi"):
        KVCacheBuilder().with_method("turbo").build()


def test_factory_and_builder_agree():
    assert KVCacheFactory.methods() == ("fp16", "int4", "int8", "kivi")
    built = KVCacheBuilder().with_method("int8").with_head_dim(64).with_group_size(64).config()
    assert built == KVCacheConfig(method="int8", head_dim=64, group_size=64)
    assert isinstance(KVCacheFactory.create(built), KVCache)
    with pytest.raises(ValueError):
        KVCacheFactory.create({"method": "fp16"})


def test_wrong_vector_shape_is_rejected():
    cache = KVCacheBuilder().with_head_dim(64).build()
    with pytest.raises(ValueError):
        cache.append_key(mx.ones((65,)))
