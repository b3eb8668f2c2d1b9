"""Quantized KV blocks (``--kv-format int8|int4``): the serving path against mlx_lm's own
quantized cache, the pool's sizing and format tags, prefix caching and the disk tier on
compressed pages, and the refusals."""

from __future__ import annotations

import collections
import random
import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from tests.conftest import assert_engine_all_free
from tests.engine.conftest import refused_at_start, wait_idle
from veloxquant_mlx.engine.hosts.thread import Engine, EngineConfig
from veloxquant_mlx.engine.types import FinishEvent, GenerationRequest, SamplingParams
from veloxquant_mlx.kv import codec as kv_codec
from veloxquant_mlx.kv.quantized import QuantizedDenseKV
from veloxquant_mlx.kv.quantized_check import check_kernels
from veloxquant_mlx.kv.step import StepCache

GREEDY = SamplingParams(temperature=0.0)
BITS = {"int8": 8, "int4": 4}


def test_formats_parse_and_refuse_with_one_line():
    codec = kv_codec.parse("int8", "bfloat16", 128, None)
    assert (codec.bits, codec.group_size, codec.dtype) == (8, 64, mx.bfloat16)
    assert kv_codec.parse("int4", "float32", 32, None).group_size == 32  # 64 does not divide
    assert not kv_codec.parse("auto", "float16", 64, None).quantized
    assert not kv_codec.parse("fp16", "float16", 64, None).quantized  # the model's own type
    # a 128-wide bf16 head: 256 bytes a token; int8 136 (1.88x), int4 72 (3.56x)
    assert codec.bytes_per_head_token(128) == 136
    assert kv_codec.parse("int4", "bfloat16", 128, None).bytes_per_head_token(128) == 72
    for args, words in (
        (("int8", "float32", 48, 32), "head_dim 48 is not a multiple of the group size 32"),
        (("int4", "float32", 32, 64), "head_dim 32 is not a multiple of the group size 64"),
        (("fp16", "bfloat16", 64, None), "a float format other than the model's"),
        (("int3", "bfloat16", 64, None), "--kv-format must be one of"),
    ):
        with pytest.raises(ValueError, match=words) as info:
            kv_codec.parse(*args)
        assert "\n" not in str(info.value)


def prefill(model, prompt: list[int]) -> tuple[list[tuple[mx.array, mx.array]], int]:
    caches = [KVCache() for _ in model.layers]
    logits = model(mx.array([prompt]), cache=caches)
    return [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in caches], int(
        mx.argmax(logits[0, -1])
    )


def stock_step(model, layers, token: int, fmt: str, group: int) -> mx.array:
    """mlx_lm's own quantized cache filled with the same full-precision prefill KV, one step."""
    caches = [QuantizedKVCache(group_size=group, bits=BITS[fmt]) for _ in layers]
    for c, (k, v) in zip(caches, layers, strict=True):
        c.update_and_fetch(k, v)
    return model(mx.array([[token]]), cache=caches)[0, -1]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_decode_step_matches_mlx_lms_quantized_cache(default_model, fmt):
    """Rows at different positions (a masked step) and one row alone (unmasked): each row's
    logits are mlx_lm's ``QuantizedKVCache`` step's for that row alone."""
    model, _ = default_model
    codec = kv_codec.parse(fmt, "float32", model.layers[0].self_attn.head_dim, None)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (7, 19)]
    rows = [prefill(model, p) for p in prompts]
    for batch_rows in ([0, 1], [1]):
        kv = QuantizedDenseKV(len(model.layers), codec)
        for slot, i in enumerate(batch_rows):
            kv.put_row(slot, rows[i][0], None)
        batch = kv.step_batch([len(prompts[i]) for i in batch_rows])
        kv.begin_step(batch, 0)
        caches = [StepCache(kv, layer, batch) for layer in range(len(model.layers))]
        tokens = mx.array([[rows[i][1]] for i in batch_rows])
        ours = model(tokens, cache=caches)[:, -1]
        for slot, i in enumerate(batch_rows):
            stock = stock_step(model, rows[i][0], rows[i][1], fmt, codec.group_size)
            assert mx.allclose(ours[slot], stock, atol=1e-4).item(), (batch_rows, i)


def test_a_step_reads_whole_rows_and_the_capacity_follows_the_width():
    """A quantized step reads every row's whole capacity (contiguous operands, which MLX's
    CUDA quantized_matmul needs), masked past each row's length; the capacity grows with the
    widest row and comes back down when it leaves, keeping the other rows' codes."""
    codec = kv_codec.parse("int8", "float32", 64, None)
    kv = QuantizedDenseKV(1, codec)
    rng = mx.random.normal((1, 2, 600, 64))
    kv.put_row(0, [(rng, rng)], None)
    kv.put_row(1, [(rng[:, :, :9], rng[:, :, :9])], None)
    batch = kv.step_batch([600, 9])
    kv.begin_step(batch, 0)
    new = mx.zeros((2, 2, 1, 64))
    keys, _ = kv.write_read(0, new, new, batch)
    assert keys[0].shape[2] == kv.capacity == 640 and batch.read_width == 640
    assert batch.mask(None).shape == (2, 1, 1, 640)
    assert mx.array_equal(batch.mask(None)[1, 0, 0], mx.arange(640) <= 9).item()
    before = kv.row_span(1, 0, 10)
    one = kv.step_batch([10])  # the long row left: one row, unmasked before, masked now
    kv.begin_step(one, 0)
    assert kv.capacity == 128 and one.read_width == 128 and one.mask(None) is not None
    for kept, was in zip(kv.row_span(1, 0, 10)[0][0], before[0][0], strict=True):
        assert mx.array_equal(kept, was).item()  # the shrink kept row 1's codes


def stock_quantized_tokens(model, prompt: list[int], n: int, fmt: str, group: int) -> list[int]:
    """Full-precision prefill, then mlx_lm's quantized cache for every decode step."""
    layers, token = prefill(model, prompt)
    caches = [QuantizedKVCache(group_size=group, bits=BITS[fmt]) for _ in layers]
    for c, (k, v) in zip(caches, layers, strict=True):
        c.update_and_fetch(k, v)
    out = [token]
    while len(out) < n:
        logits = model(mx.array([[out[-1]]]), cache=caches)
        out.append(int(mx.argmax(logits[0, -1])))
    return out


@pytest.mark.parametrize(
    ("fmt", "attention"), [("int8", "mlx"), ("int4", "mlx"), ("int8", "fused"), ("int4", "fused")]
)
def test_served_tokens_match_mlx_lms_quantized_cache_with_rows_joining_and_leaving(
    make_engine, default_model, fmt, attention
):
    """Eight prompts at once through 3 running slots and 16-token prefill chunks: every
    request's greedy tokens are a full-precision prefill followed by mlx_lm's quantized cache
    (the serving path adds nothing of its own to the quantization), with mlx_lm's quantized
    attention and through ``--quantized-attention fused``'s route alike; the blocks carry the
    format's tag while they are held; the pool is all free after."""
    engine = make_engine(
        kv_cache_mb=8,
        kv_format=fmt,
        max_running=3,
        prefill_step=16,
        prefix_caching=False,
        quantized_attention=attention,
    )
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (5, 23, 9, 41, 3, 17, 30, 12)]
    lengths = [12, 5, 20, 9, 16, 3, 11, 7]
    handles = [
        engine.submit(GenerationRequest(tuple(p), n, GREEDY))
        for p, n in zip(prompts, lengths, strict=True)
    ]
    formats: set[str] = set()
    while not all(h.done for h in handles):  # the blocks of whatever runs now
        formats |= {
            b.format for o in engine.pool.owner_block_counts() for b in engine.pool.blocks_for(o)
        }
    for h, p, n in zip(handles, prompts, lengths, strict=True):
        tokens, finish = h.collect(120)
        assert isinstance(finish, FinishEvent) and finish.finish_reason == "length"
        expected = stock_quantized_tokens(default_model[0], p, n, fmt, 32)
        assert [t.token_id for t in tokens] == expected
    assert formats == {fmt} and engine.stats().kv_format == fmt
    wait_idle(engine)


def test_a_quantized_pool_holds_more_tokens_in_the_same_budget(make_engine):
    """The same --kv-cache-mb: blocks are sized by the format's bytes (the embedded model's KV
    is float32 with 32-wide heads: 128 bytes a head and token, int8 40, int4 24)."""
    counts = {}
    for fmt in ("auto", "int8", "int4"):
        engine = make_engine(kv_cache_mb=4, kv_format=fmt)
        counts[fmt] = (engine.pool.stats.n_blocks, engine.kv_bytes_per_block)
    assert counts["int8"][0] / counts["auto"][0] >= 3.1
    assert counts["int4"][0] / counts["auto"][0] >= 5.2
    for n, per_block in counts.values():  # the same bytes, within one block
        assert abs(n * per_block - 4 * 2**20) < per_block


def test_cached_pages_stay_compressed_and_are_hit(make_engine):
    """A prompt's pages are cached as quantized spans; the same prompt again hits them and
    decodes the same tokens as the first time's second run (both start from those pages)."""
    engine = make_engine(kv_cache_mb=8, kv_format="int8")
    prompt = tuple(random.Random(4).randrange(3, 2000) for _ in range(70))
    runs = []
    for _ in range(3):
        tokens, finish = engine.submit(GenerationRequest(prompt, 6, GREEDY)).collect(60)
        runs.append(([t.token_id for t in tokens], finish.usage.cached_tokens))
    assert runs[0][1] == 0 and runs[1][1] >= 64 and runs[2][1] >= 64
    assert runs[1][0] == runs[2][0]
    cache = engine._core.scheduler.cache
    pages = list(cache.pages())
    assert pages
    span, _ = pages[0].kv
    k_parts = span[0][0]
    assert len(k_parts) == 3 and k_parts[0].dtype == mx.uint32


def test_the_disk_tier_keeps_compressed_pages_across_a_restart(default_model_dir, tmp_path):
    """Pages written at a stop hold the quantized parts, and a restarted engine loads them and
    decodes what a hit in memory decoded."""
    prompt = tuple(random.Random(6).randrange(3, 2000) for _ in range(70))
    config = EngineConfig(
        model_cache_dir=str(default_model_dir.parent),
        kv_cache_mb=8,
        kv_format="int8",
        prefix_cache_dir=str(tmp_path),
    )
    results = []
    for runs in (2, 1):
        engine = Engine(config).start()
        try:
            engine.wait_ready(120)
            for _ in range(runs):
                tokens, finish = engine.submit(GenerationRequest(prompt, 6, GREEDY)).collect(60)
                results.append(([t.token_id for t in tokens], finish.usage.cached_tokens))
            wait_idle(engine)
            assert_engine_all_free(engine)
        finally:
            engine.shutdown(10)
    assert results[2][1] >= 64, "the restarted engine loaded the pages from disk"
    assert results[2][0] == results[1][0]
    files = list(tmp_path.rglob("*.safetensors"))
    assert files
    names = set(mx.load(str(files[0])))
    assert {"0.k", "0.k.1", "0.k.2", "0.v", "0.v.1", "0.v.2"} <= names


def test_a_quantized_format_with_the_paged_layout_is_refused(default_model_dir):
    refused_at_start(
        EngineConfig(
            model_cache_dir=str(default_model_dir.parent), kv_format="int8", kv_layout="paged"
        ),
        "--kv-format int8 needs --kv-layout dense",
    )


def test_a_backend_without_the_kernel_is_refused_at_start_in_one_line(monkeypatch):
    """MLX 0.32's CUDA backend has no quantized_matmul for some operands (it raised at the
    first decode step); that cannot happen on this CPU, so the backend's error is stood in for
    here, and the refusal must name the format and what to try."""
    from mlx_lm.models import base

    codec = kv_codec.parse("int8", "bfloat16", 64, None)
    check_kernels(codec, 32, 8, 64)  # this backend has the kernel

    def missing(*args, **kwargs):
        raise RuntimeError("[quantized_matmul] No implementation for problem shape: 1x9x64x32")

    monkeypatch.setattr(base, "quantized_scaled_dot_product_attention", missing)
    with pytest.raises(ValueError, match="try --kv-group-size 32 or --kv-format auto") as info:
        check_kernels(codec, 32, 8, 64)
    assert "\n" not in str(info.value) and "No implementation" in str(info.value)


def test_rows_preempted_from_a_quantized_pool_come_back_and_finish(make_engine):
    """Four long requests in a pool that holds about three: rows are preempted (their pages
    cached compressed) and resumed, every request ends with all its tokens, nothing leaks."""
    engine = make_engine(n_blocks=220, kv_cache_mb=None, kv_format="int4", prefill_step=32)
    rng = random.Random(8)
    prompts = [tuple(rng.randrange(3, 2000) for _ in range(40)) for _ in range(4)]
    handles = [engine.submit(GenerationRequest(p, 100, GREEDY)) for p in prompts]
    for h in handles:
        tokens, finish = h.collect(120)
        assert finish.finish_reason == "length" and len(tokens) == 100
    assert engine.stats().preemptions_total > 0
    wait_idle(engine)


def write_arch_model(arch: str, target) -> None:
    """A random-weight model of ``tests.engine.test_layouts.ARCHS[arch]`` in ``target``."""
    import json
    import shutil

    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from tests.engine.test_layouts import ARCHS
    from veloxquant_mlx.engine.model.default_model import ASSETS, CONFIG, TOKENIZER_FILES

    config = {**CONFIG, **ARCHS[arch]}
    model_class, args_class = _get_classes(config)
    mx.random.seed(7)
    model = model_class(args_class.from_dict(config))
    mx.save_safetensors(str(target / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (target / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        shutil.copyfile(ASSETS / name, target / name)


@pytest.mark.parametrize("arch", ["qwen3", "llama_sliding"])
def test_other_attention_kinds_serve_quantized(tmp_path, arch):
    """q/k norms (qwen3) and sliding-window layers (their masks go to the quantized attention):
    served in int8 alongside each other, every request completes, nothing leaks."""
    write_arch_model(arch, tmp_path)
    engine = Engine(
        EngineConfig(model=str(tmp_path), kv_cache_mb=8, kv_format="int8", max_running=3)
    ).start()
    try:
        engine.wait_ready(120)
        rng = random.Random(2)
        prompts = [tuple(rng.randrange(3, 2000) for _ in range(n)) for n in (5, 30, 12, 21)]
        handles = [engine.submit(GenerationRequest(p, 15, GREEDY)) for p in prompts]
        for h in handles:
            tokens, finish = h.collect(120)
            assert finish.finish_reason == "length" and len(tokens) == 15
        wait_idle(engine)
        assert_engine_all_free(engine)
    finally:
        engine.shutdown(5)


class MixedReference:
    """A stock-protocol cache holding a row's KV as a window would see it: positions before
    the newest ``recent`` quantized and dequantized again, the newest in full precision."""

    def __init__(self, k: mx.array, v: mx.array, codec, recent: int) -> None:
        self.k, self.v, self.codec, self.recent = k, v, codec, recent
        self.offset = k.shape[2]

    def update_and_fetch(self, nk: mx.array, nv: mx.array) -> tuple[mx.array, mx.array]:
        out = []
        for x in (mx.concatenate([self.k, nk], axis=2), mx.concatenate([self.v, nv], axis=2)):
            cut = max(0, x.shape[2] - self.recent)
            if cut:
                old = self.codec.decode(self.codec.encode(x[:, :, :cut]))
                x = mx.concatenate([old, x[:, :, cut:]], axis=2)
            out.append(x)
        return out[0], out[1]

    def make_mask(self, n: int, return_array: bool = False, window_size=None):
        return None


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_residual_window_attends_over_full_precision_recent_tokens(default_model, fmt):
    """--kv-recent-tokens: each row's newest tokens come from the full-precision ring and the
    older ones from the codes, in one softmax: a row longer than the window and one shorter
    (all of it in the ring), batched at different positions, each equal to a reference
    attending over exactly that mixture."""
    from veloxquant_mlx.kv import attention

    model, _ = default_model
    attention.install(model)
    recent = 12
    codec = kv_codec.parse(fmt, "float32", model.layers[0].self_attn.head_dim, None)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (29, 7)]
    rows = [prefill(model, p) for p in prompts]
    kv = QuantizedDenseKV(len(model.layers), codec, recent=recent)
    for slot, (layers, _) in enumerate(rows):
        kv.put_row(slot, layers, None)
    batch = kv.step_batch([len(p) for p in prompts])
    kv.begin_step(batch, 0)
    caches = [StepCache(kv, layer, batch) for layer in range(len(model.layers))]
    ours = model(mx.array([[t] for _, t in rows]), cache=caches)[:, -1]
    assert all(c.attended for c in caches)
    for slot, (layers, token) in enumerate(rows):
        ref = [MixedReference(k, v, codec, recent) for k, v in layers]
        expected = model(mx.array([[token]]), cache=ref)[0, -1]
        assert mx.allclose(ours[slot], expected, atol=1e-4).item(), slot


def test_a_residual_window_serves_and_is_accounted_in_the_pool(make_engine):
    """int4 with a 16-token window: rows join and leave and every request completes; while a
    row runs the pool holds its window as blocks tagged with the model's type beside its int4
    blocks (mixed formats in one pool), and they are counted in the snapshot."""
    engine = make_engine(kv_cache_mb=8, kv_format="int4", max_running=4, kv_recent_tokens=16)
    # per stream, the embedded model's window: 4 layers x 4 KV heads x 32 x 16 tokens x 4 bytes
    # (32 KiB), in blocks of int4's 16 tokens x 4 heads x (16 + 8) bytes: 22 (rounded up)
    window = -(-(4 * 4 * 32 * 16 * 4) // engine.kv_bytes_per_block)
    assert engine.kv_bytes_per_block == 16 * 4 * 24 and window == 22
    rng = random.Random(9)
    prompts = [tuple(rng.randrange(3, 2000) for _ in range(n)) for n in (5, 40, 18, 9, 33, 26)]
    handles = [engine.submit(GenerationRequest(p, 24, GREEDY)) for p in prompts]
    seen, formats = 0, collections.Counter()
    while not all(h.done for h in handles):
        stats = engine.stats()
        if stats.running:
            assert stats.kv_window_format == "float32"
            seen = max(seen, stats.kv_window_blocks)
        for owner in engine.pool.owner_block_counts():
            formats.update(b.format for b in engine.pool.blocks_for(owner))
        time.sleep(0.002)
    for h in handles:
        tokens, finish = h.collect(120)
        assert finish.finish_reason == "length" and len(tokens) == 24
    assert seen >= 2 * window and seen % (2 * window) == 0
    assert set(formats) == {"int4", "float32"}
    wait_idle(engine)


def test_a_window_is_refused_where_it_cannot_work(default_model_dir, tmp_path):
    """Without a quantized format, a window the pool cannot hold with one request, and a
    model with sliding-window layers: refused at start, one line each."""
    write_arch_model("llama_sliding", tmp_path)
    base = {"model_cache_dir": str(default_model_dir.parent), "kv_recent_tokens": 16}
    for overrides, words in (
        ({}, "--kv-recent-tokens needs --kv-format int8 or int4"),
        ({"kv_format": "int8", "kv_cache_mb": 0.05}, "cannot hold even one request"),
        ({"kv_format": "int8", "model": str(tmp_path)}, "use --kv-recent-tokens 0"),
    ):
        error = refused_at_start(EngineConfig(**{**base, **overrides}), words)
        assert "\n" not in str(error)
