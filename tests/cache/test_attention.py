"""Ragged decode attention in plain MLX ops (kv/attention.py): the same numbers as MLX's own
masked attention, and routed only where a ``StepCache`` asks for it."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import base, llama

from veloxquant_mlx.kv import attention, chunk_attention
from veloxquant_mlx.kv.attention import RaggedAttention
from veloxquant_mlx.kv.dense import DenseKV
from veloxquant_mlx.kv.paged import PagedKV
from veloxquant_mlx.kv.step import READ_CHUNK, StepCache


def qkv(rows: int, n_heads: int, n_kv: int, width: int, d: int = 16, capacity: int = 0):
    """Queries and a strided K/V view of a wider working set, as a dense step fetches them."""
    mx.random.seed(rows * 100 + n_heads)
    cap = max(capacity, width)
    q = mx.random.normal((rows, n_heads, 1, d))
    k = mx.random.normal((rows, n_kv, cap, d))[:, :, :width]
    v = mx.random.normal((rows, n_kv, cap, d))[:, :, :width]
    return q, k, v


def length_mask(lengths: list[int], width: int) -> mx.array:
    return (mx.arange(width)[None, :] < mx.array(lengths)[:, None])[:, None, None, :]


@pytest.mark.parametrize(("n_heads", "n_kv"), [(4, 4), (8, 2), (6, 1)])
def test_matmul_attention_equals_mlx_masked_attention(n_heads, n_kv):
    lengths = [33, 1, 17, 40, 5]
    q, k, v = qkv(len(lengths), n_heads, n_kv, 40, capacity=64)
    scale = 16**-0.5
    for mask in (length_mask(lengths, 40), mx.where(length_mask(lengths, 40), 0.0, -mx.inf)):
        ours = attention.matmul_attention(q, k, v, scale, mask)
        theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        assert ours.shape == theirs.shape == (5, n_heads, 1, 16)
        assert mx.allclose(ours, theirs, atol=1e-6).item()


def test_matmul_attention_honours_a_window_mask():
    """A sliding-window layer's mask: each row sees only its last 4 positions."""
    pos = mx.array([9, 3, 6])[:, None]
    cols = mx.arange(10)[None, :]
    mask = ((cols <= pos) & (cols > pos - 4))[:, None, None, :]
    q, k, v = qkv(3, 4, 2, 10)
    ours = attention.matmul_attention(q, k, v, 0.25, mask)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    assert mx.allclose(ours, theirs, atol=1e-6).item()


def test_matmul_attention_takes_one_query_per_row():
    q, k, v = qkv(2, 4, 2, 8)
    with pytest.raises(ValueError, match="one query per row"):
        attention.matmul_attention(
            mx.concatenate([q, q], axis=2), k, v, 0.25, length_mask([8, 3], 8)
        )


def test_auto_is_mlx_own_on_a_cpu_and_bad_modes_are_refused():
    assert attention.choose("auto").mode == ("matmul" if mx.default_device() == mx.gpu else "sdpa")
    assert attention.choose("matmul").mode == "matmul"
    with pytest.raises(ValueError, match="ragged attention must be one of"):
        attention.choose("flash")


def test_the_exp2_softmax_is_auto_on_a_cpu_only_and_can_be_chosen():
    assert attention.choose("auto", gpu=False).exp2
    assert not attention.choose("auto", gpu=True).exp2
    # a CPU's prefill chunks take it on the host; decode steps keep MLX's powers
    assert attention.choose("auto", gpu=False).prefill_route == "host"
    assert attention.choose("auto", gpu=False, softmax="exp2").prefill_route == "exp2"
    assert attention.choose("matmul", gpu=True, softmax="host").prefill_route == "host"
    assert attention.choose("auto", gpu=True).prefill_route is None
    assert attention.choose("matmul", gpu=True, softmax="exp2").exp2
    assert not attention.choose("sdpa", gpu=False, softmax="exp").exp2
    with pytest.raises(ValueError, match="attention softmax must be one of"):
        attention.choose("auto", softmax="exp10")


def test_prefill_by_buckets_is_auto_on_cuda_only_and_matmul_can_be_chosen():
    """cuDNN (CUDA) builds a graph per new prefill shape, so there prefill attends over
    bucketed shapes (whose graphs the warm-up builds); Metal and the CPU have no such cost (the
    CPU's prefill is grouped anyway, for its exp2 softmax)."""
    cuda = attention.choose("auto", gpu=True, cuda=True)
    assert cuda.prefill_buckets and cuda.prefill_route == "buckets"
    assert attention.choose("auto", gpu=True, cuda=True, prefill="matmul").prefill_route == "exp"
    metal = attention.choose("auto", gpu=True, cuda=False)
    assert not metal.prefill_matmul and metal.prefill_route is None
    cpu = attention.choose("auto", gpu=False)
    assert not cpu.prefill_matmul and cpu.prefill_route == "host"
    assert attention.choose("auto", gpu=True, cuda=False, prefill="matmul").prefill_route == "exp"
    assert attention.choose("sdpa", gpu=False, softmax="exp", prefill="sdpa").prefill_route is None
    with pytest.raises(ValueError, match="prefill attention must be one of"):
        attention.choose("auto", prefill="flash")


def test_key_buckets_are_four_an_octave_and_never_shorter():
    lengths = range(1, 40_000, 7)
    buckets = {chunk_attention.key_bucket(n) for n in lengths}
    assert all(chunk_attention.key_bucket(n) >= n for n in lengths)
    most = chunk_attention.KEY_BUCKET_MIN
    assert all(chunk_attention.key_bucket(n) <= n + max(most, n // 4) for n in lengths)
    assert len([b for b in buckets if 16_384 <= b < 32_768]) == 4
    assert chunk_attention.key_bucket(8192) == 8192 and chunk_attention.key_bucket(8193) == 10240


def test_the_warm_up_meets_every_bucket_shortest_keys_first_within_its_time():
    shapes = chunk_attention.bucket_shapes(512, 8192)
    assert shapes[:3] == [(64, 256), (128, 256), (256, 256)]  # no wider than its keys
    assert [k for _, k in shapes] == sorted(k for _, k in shapes)
    keys = {k for _, k in shapes}
    assert max(keys) == 8192 and all(chunk_attention.key_bucket(k) == k for k in keys)
    # every chunk of up to 512 tokens over up to 8,192 keys lands on one of them
    for n_q, length in ((1, 5), (64, 300), (200, 4000), (512, 8192), (37, 777)):
        if n_q > 1:
            want = (chunk_attention.query_bucket(n_q), chunk_attention.key_bucket(length))
            assert want in shapes, (n_q, length)
    assert chunk_attention.warm_buckets(4, 2, 16, mx.float32, shapes[:3], 60.0) == 3
    assert chunk_attention.warm_buckets(4, 2, 16, mx.float32, shapes, -1.0) == 0  # out of time


def test_buckets_are_chosen_by_name_off_cuda():
    assert attention.choose("auto", gpu=True, cuda=True, prefill="buckets").prefill_route == (
        "buckets"
    )
    assert attention.choose("auto", gpu=False, prefill="buckets").prefill_route == ("buckets")


@pytest.mark.parametrize(("n_q", "length"), [(2, 2), (7, 300), (64, 1000), (5, 256)])
def test_bucketed_attention_is_causal_attention_over_the_unpadded_keys(n_q, length):
    """The keys padded to their bucket and the padding masked: MLX's causal attention over the
    keys as they are; other masks and single queries take the grouped route."""
    q, k, v = (a[:1] for a in prefill_qkv(n_q, 8, 2, length))
    buffer = [mx.concatenate([a, mx.ones_like(a)], axis=2) for a in (k, v)]
    for keys, values in ((k, v), (buffer[0][:, :, :length], buffer[1][:, :, :length])):
        ours = chunk_attention.bucketed_attention(q, keys, values, 0.25, "causal")
        theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
        assert mx.allclose(ours, theirs, atol=1e-5).item()
    per_row = (mx.arange(n_q)[:, None] + (length - n_q)) >= mx.arange(length)[None]
    ours = chunk_attention.bucketed_attention(q, k, v, 0.25, per_row)
    assert mx.allclose(
        ours, chunk_attention.grouped_attention(q, k, v, 0.25, per_row, False)
    ).item()


def prefill_qkv(n_q: int, n_heads: int, n_kv: int, length: int, rows: int = 2, d: int = 16):
    mx.random.seed(n_q * 1000 + length)
    return (
        mx.random.normal((rows, n_heads, n_q, d)),
        mx.random.normal((rows, n_kv, length, d)),
        mx.random.normal((rows, n_kv, length, d)),
    )


@pytest.mark.parametrize("softmax", ["exp", "exp2", "host"])
@pytest.mark.parametrize(("n_heads", "n_kv"), [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize(("n_q", "length"), [(1, 1), (1, 37), (7, 7), (9, 60)])
def test_grouped_attention_equals_mlx_attention_under_every_mask_kind(
    n_heads, n_kv, n_q, length, softmax, monkeypatch
):
    """No mask, "causal" (the queries are the last ``n_q`` positions), a bool mask per row, an
    additive one, and one per query head; what MLX's own gives, to float32 rounding, with
    MLX's softmax, the exp2 one and the exp2 one by numpy (``host``, here at any size)."""
    monkeypatch.setattr(chunk_attention, "HOST_MIN_SCORES", 0)
    exp2, host = softmax != "exp", softmax == "host"
    q, k, v = prefill_qkv(n_q, n_heads, n_kv, length)
    scale = 16**-0.5
    cols = mx.arange(length)[None, :]
    causal = (mx.arange(n_q)[:, None] + (length - n_q)) >= cols  # [n_q, length]
    per_row = (
        causal[None, None]
        & (cols < mx.array([length, max(1, length - 3)])[:, None])[:, None, None, :]
    )
    per_head = mx.broadcast_to(per_row, (2, n_heads, n_q, length)) & (
        mx.arange(n_heads)[None, :, None, None] % 2 == 0
    ) | (cols[None, None] == 0)
    masks: list = [None, "causal", per_row, mx.where(per_row, 0.0, -mx.inf), per_head]
    for mask in masks:
        ours = chunk_attention.grouped_attention(q, k, v, scale, mask, exp2, host)
        theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        assert ours.shape == theirs.shape == (2, n_heads, n_q, 16)
        assert mx.allclose(ours, theirs, atol=1e-5).item(), mask


def test_grouped_attention_takes_a_long_chunk_in_pieces_of_queries(monkeypatch):
    """Past ``SCORES_AT_ONCE`` scores the queries go in pieces, each with its rows of the
    mask: the same numbers as at once."""
    q, k, v = prefill_qkv(37, 8, 2, 90)
    per_row = (mx.arange(37)[:, None] + 53) >= mx.arange(90)[None]
    whole = [chunk_attention.grouped_attention(q, k, v, 0.25, m) for m in ("causal", per_row)]
    monkeypatch.setattr(chunk_attention, "SCORES_AT_ONCE", 2 * 8 * 90 * 5)  # 5 queries a piece
    for mask, expected in zip(("causal", per_row), whole, strict=True):
        pieces = chunk_attention.grouped_attention(q, k, v, 0.25, mask)
        assert mx.allclose(pieces, expected, atol=1e-6).item()
        theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
        assert mx.allclose(pieces, theirs, atol=1e-5).item()


@pytest.mark.parametrize("host", [False, True])
def test_grouped_attention_gives_a_query_that_sees_nothing_zeros_not_nan(host, monkeypatch):
    """A left-padded row's padding queries see no position (prefill of several prompts in one
    forward): their output is 0, so no NaN reaches V's padding; the other queries' output is
    MLX's."""
    monkeypatch.setattr(chunk_attention, "HOST_MIN_SCORES", 0)
    q, k, v = prefill_qkv(3, 4, 2, 3)
    for dtype in (mx.float32, mx.float16):
        q, k, v = (a.astype(dtype) for a in (q, k, v))
        mask = mx.array([[True, False, False], [False, False, False], [True, True, True]])
        ours = chunk_attention.grouped_attention(q, k, v, 0.25, mask[None, None], True, host)
        theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask[None, None])
        assert not mx.isnan(ours).any().item()
        assert (ours[:, :, 1] == 0).all().item()
        seen = mx.array([0, 2])
        assert mx.allclose(ours[:, :, seen], theirs[:, :, seen], atol=2e-3).item()


@pytest.mark.parametrize("host", [False, True])
def test_grouped_attention_keeps_a_half_precision_type_and_softmaxes_in_float32(host, monkeypatch):
    monkeypatch.setattr(chunk_attention, "HOST_MIN_SCORES", 0)
    q, k, v = (a.astype(mx.float16) for a in prefill_qkv(5, 4, 2, 30))
    ours = chunk_attention.grouped_attention(q, k, v, 0.25, "causal", True, host)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    assert ours.dtype == mx.float16
    assert mx.allclose(ours.astype(mx.float32), theirs.astype(mx.float32), atol=2e-3).item()


def step_cache(kind: str, positions: list[int]) -> StepCache:
    kv = DenseKV(1, ragged=RaggedAttention(kind))
    return StepCache(kv, 0, kv.step_batch(positions))


def test_a_step_attends_by_matmul_from_its_layouts_fewest_rows():
    """``auto`` on a GPU takes matmul from 32 rows; an explicit ``matmul`` from one."""
    kv = DenseKV(1, ragged=RaggedAttention("matmul", attention.AUTO_MATMUL_MIN_ROWS))
    assert not kv.step_batch(list(range(31))).matmul
    assert kv.step_batch(list(range(32))).matmul
    assert DenseKV(1, ragged=RaggedAttention("matmul")).step_batch([3, 9]).matmul
    assert not DenseKV(1, ragged=RaggedAttention("sdpa")).step_batch(list(range(64))).matmul
    assert not PagedKV(1, 16, 8, RaggedAttention("matmul", 32)).step_batch([3, 9]).matmul
    assert attention.choose("auto", gpu=True) == RaggedAttention("matmul", 32)
    assert attention.choose("auto", gpu=False) == RaggedAttention("sdpa", exp2=True, host=True)
    assert attention.choose("matmul").min_rows == 1
    assert kv.ragged.label == "matmul>=32"  # what /metrics labels build_info with
    assert RaggedAttention("matmul").label == "matmul"
    assert RaggedAttention("sdpa", 32).label == "sdpa"


def test_a_ragged_dense_matmul_step_reads_whole_chunks_and_masks_past_each_row():
    """Keys are read in READ_CHUNK positions (the products' shapes change every 128 steps),
    the mask as wide; a step with every row at one position reads exactly its width."""
    kv = DenseKV(1, ragged=RaggedAttention("matmul"))
    prefill = [(mx.ones((1, 2, 5, 4)), mx.ones((1, 2, 5, 4)))]
    kv.put_row(0, prefill, None)
    kv.put_row(1, prefill, None)
    ragged = kv.step_batch([5, 2])
    kv.begin_step(ragged, 0)
    keys, values = StepCache(kv, 0, ragged).update_and_fetch(
        mx.ones((2, 2, 1, 4)), mx.ones((2, 2, 1, 4))
    )
    assert ragged.width == 6 and ragged.read_width == READ_CHUNK
    assert keys.shape == values.shape == (2, 2, READ_CHUNK, 4)
    mask = ragged.mask(None)
    assert mask.shape == (2, 1, 1, READ_CHUNK)
    assert mask[0, 0, 0].tolist() == [True] * 6 + [False] * (READ_CHUNK - 6)
    assert mask[1, 0, 0].tolist() == [True] * 3 + [False] * (READ_CHUNK - 3)
    uniform = kv.step_batch([6, 6])
    kv.begin_step(uniform, 0)
    keys, _ = StepCache(kv, 0, uniform).update_and_fetch(
        mx.ones((2, 2, 1, 4)), mx.ones((2, 2, 1, 4))
    )
    assert uniform.read_width == 7 and keys.shape[2] == 7 and uniform.mask(None) is None


def test_install_routes_only_step_caches_that_ask_and_is_idempotent(monkeypatch):
    from veloxquant_mlx.engine.model.default_model import CONFIG

    monkeypatch.setattr(llama, "scaled_dot_product_attention", base.scaled_dot_product_attention)
    model = llama.Model(llama.ModelArgs.from_dict(CONFIG))
    assert attention.install(model) == 1
    assert attention.install(model) == 0  # already wrapped
    routed = llama.scaled_dot_product_attention
    assert routed.__wrapped__ is base.scaled_dot_product_attention

    calls = []
    real = attention.matmul_attention
    monkeypatch.setattr(attention, "matmul_attention", lambda *a: calls.append(1) or real(*a))
    lengths = [12, 5]
    q, k, v = qkv(2, 4, 2, 12)
    mask = length_mask(lengths, 12)
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    for cache, taken in [
        (step_cache("matmul", [11, 4]), 1),  # a ragged step that asked: routed
        (step_cache("sdpa", [11, 4]), 0),  # one that did not
        (None, 0),  # a stock call (prefill, another user of mlx_lm)
    ]:
        calls.clear()
        out = routed(q, k, v, cache=cache, scale=0.25, mask=mask)
        assert len(calls) == taken
        assert mx.allclose(out, expected, atol=1e-6).item()
    calls.clear()  # no mask (every row at one position): MLX's vector kernel, never ours
    routed(q, k, v, cache=step_cache("matmul", [11, 11]), scale=0.25, mask=None)
    routed(q, k, v, cache=step_cache("matmul", [11, 4]), scale=0.25, mask="causal")
    assert not calls


def test_install_leaves_a_function_of_the_same_name_that_is_not_mlx_lms(monkeypatch):
    """A model file may define its own ``scaled_dot_product_attention`` (other arguments)."""
    from veloxquant_mlx.engine.model.default_model import CONFIG

    def own(q, k, v, scale, mask):  # not mlx_lm's signature
        return q

    monkeypatch.setattr(llama, "scaled_dot_product_attention", own)
    assert attention.install(llama.Model(llama.ModelArgs.from_dict(CONFIG))) == 0
    assert llama.scaled_dot_product_attention is own


def test_a_working_set_allocates_the_rows_it_holds_to_the_next_power_of_two():
    """A lone row (one agent session) gets one row of working set, not ``ROW_CHUNK``; rows
    grow by powers of two up to ``ROW_CHUNK``, then by chunks, keeping every row's KV."""
    from veloxquant_mlx.kv.dense import ROW_CHUNK, rows_to_allocate

    assert [rows_to_allocate(0, n) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert rows_to_allocate(1, 2) == 2 and rows_to_allocate(2, 3) == 4
    assert rows_to_allocate(ROW_CHUNK, ROW_CHUNK + 1) == 2 * ROW_CHUNK
    assert rows_to_allocate(1, 1) == 1 and rows_to_allocate(4, 3) == 4  # no growth asked
    kv = DenseKV(2)
    first = [(mx.full((1, 2, 5, 4), float(i)), mx.full((1, 2, 5, 4), -float(i))) for i in (1, 2)]
    kv.put_row(0, first, None)
    kv.begin_step(kv.step_batch([5]), 0)  # a step of that one row: still one
    assert kv.rows == 1 and kv.k[0].shape[0] == 1
    for row in (1, 2):
        kv.put_row(row, [(k * (row + 2), v * (row + 2)) for k, v in first], None)
    assert kv.rows == 4 and kv.k[1].shape[0] == 4
    assert mx.array_equal(kv.k[1][0, :, :5], first[1][0][0]).item()
    assert mx.array_equal(kv.v[0][1, :, :5], 3 * first[0][1][0]).item()
    assert mx.array_equal(kv.k[0][2, :, :5], 4 * first[0][0][0]).item()
