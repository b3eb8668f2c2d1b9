"""A KV format per request (``--kv-formats``, ``GenerationRequest.kv_format``): rows of three
formats decoding in one batch each give what their format gives alone, a page of a wider
format takes more of the pool, the prefix cache keeps formats apart, and what is not allowed
is refused."""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import refused_at_start, wait_idle
from tests.engine.test_kv_format import stock_quantized_tokens
from tests.engine.test_layouts import stock_tokens
from veloxquant_mlx.engine.hosts.thread import EngineConfig
from veloxquant_mlx.engine.loop.scheduler import Scheduler
from veloxquant_mlx.engine.loop.seq import Seq
from veloxquant_mlx.engine.request.handle import RequestHandle
from veloxquant_mlx.engine.types import (
    FinishEvent,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
)
from veloxquant_mlx.pool import BlockPoolAllocator, PoolConfig

GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize(
    ("ragged", "quantized"), [("auto", "mlx"), ("matmul", "mlx"), ("auto", "fused")]
)
def test_rows_of_three_formats_in_one_batch_each_decode_as_their_format(
    make_engine, default_model, ragged, quantized
):
    """Nine prompts through 4 running slots and 16-token prefill chunks, in int8 (the
    server's own), float32 and int4: every request's greedy tokens are its format's alone
    (mlx_lm's KVCache, or a full-precision prefill and mlx_lm's QuantizedKVCache), while rows
    of the other formats join and leave beside it; blocks carry each format's tag. With
    ``matmul`` every part of a step attends as the whole batch is planned (by matmul, in
    128-position reads), as a GPU's batches of 32 rows or more do. With ``fused`` the
    quantized rows attend through ``--quantized-attention fused``'s route."""
    engine = make_engine(
        ragged_attention=ragged,
        quantized_attention=quantized,
        kv_cache_mb=8,
        kv_format="int8",
        kv_formats=("fp32", "int4"),
        max_running=4,
        prefill_step=16,
        prefix_caching=False,
    )
    model = default_model[0]
    rng = random.Random(11)
    lengths = (5, 23, 9, 41, 3, 17, 30, 12, 26)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in lengths]
    asks = ["", "fp32", "int4", "int8", "fp32", "int4", "", "fp32", "int4"]
    news = [12, 5, 20, 9, 16, 3, 11, 7, 14]
    handles = [
        engine.submit(GenerationRequest(tuple(p), n, GREEDY, kv_format=f))
        for p, n, f in zip(prompts, news, asks, strict=True)
    ]
    formats: set[str] = set()
    while not all(h.done for h in handles):
        formats |= {
            b.format for o in engine.pool.owner_block_counts() for b in engine.pool.blocks_for(o)
        }
    for h, p, n, f in zip(handles, prompts, news, asks, strict=True):
        tokens, finish = h.collect(120)
        assert isinstance(finish, FinishEvent) and finish.finish_reason == "length"
        if f == "fp32":
            expected = stock_tokens(model, p, n)
        else:
            expected = stock_quantized_tokens(model, p, n, f or "int8", 32)
        assert [t.token_id for t in tokens] == expected, (f, len(p))
    assert formats == {"int8", "float32", "int4"}
    assert engine.stats().ragged_attention == ("matmul" if ragged == "matmul" else "sdpa")
    wait_idle(engine)


def test_a_residual_window_keeps_each_quantized_format_as_its_own_server_would(make_engine):
    """--kv-recent-tokens with --kv-formats: the rows of each quantized format keep their
    newest 12 tokens in full precision (blocks of the model's type held while they run), the
    float rows none; every row's greedy tokens are what a server of its format alone, with
    the same window, gives."""
    mixed = make_engine(
        kv_cache_mb=8, kv_format="auto", kv_formats=("int8", "int4"), kv_recent_tokens=12,
        max_running=4, prefill_step=16, prefix_caching=False,
    )  # fmt: skip
    rng = random.Random(21)
    lengths = (5, 23, 9, 41, 17, 30)
    prompts = [tuple(rng.randrange(3, 2000) for _ in range(n)) for n in lengths]
    asks = ["int8", "", "int4", "int8", "int4", ""]
    handles = [
        mixed.submit(GenerationRequest(p, 20, GREEDY, kv_format=f))
        for p, f in zip(prompts, asks, strict=True)
    ]
    windows: set[int] = set()
    while not all(h.done for h in handles):
        stats = mixed.stats()
        if stats.running:
            windows.add(stats.kv_window_blocks)
    got = [[t.token_id for t in h.collect(120)[0]] for h in handles]
    assert max(windows) > 0  # held while a quantized row ran
    wait_idle(mixed)
    assert mixed.stats().kv_window_blocks == 0
    for fmt in ("int8", "int4", ""):
        alone = make_engine(
            kv_cache_mb=8, kv_format=fmt or "auto", kv_recent_tokens=12 if fmt else 0,
            prefix_caching=False,
        )  # fmt: skip
        for p, f, tokens in zip(prompts, asks, got, strict=True):
            if f == fmt:
                want, _ = alone.submit(GenerationRequest(p, 20, GREEDY)).collect(120)
                assert tokens == [t.token_id for t in want], (fmt, len(p))


def test_a_wider_format_takes_its_bytes_of_the_pool(make_engine):
    """Blocks are sized for the smallest format (int4: 24 bytes a head and token for the
    embedded model's 32-wide float32 heads); a float32 page takes ceil(128 / 24) = 6 of them
    and an int8 page (40 bytes) 2, so a request's peak blocks follow its format's bytes."""
    engine = make_engine(kv_cache_mb=8, kv_format="int4", kv_formats=("fp32", "int8"))
    prompt = tuple(random.Random(12).randrange(3, 2000) for _ in range(40))
    peaks = {}
    for fmt in ("", "auto", "fp32", "int8"):
        _, finish = engine.submit(GenerationRequest(prompt, 8, GREEDY, kv_format=fmt)).collect(60)
        peaks[fmt] = finish.usage.peak_kv_blocks
    assert peaks["fp32"] == 6 * peaks[""] and peaks["auto"] == peaks[""]  # auto: the own
    assert peaks["int8"] == 2 * peaks[""]
    assert finish.usage.peak_kv_bytes == peaks["int8"] * engine.kv_bytes_per_block


def test_the_prefix_cache_keeps_formats_apart(make_engine):
    """The same prompt in int8 then float32: no hit across formats; float32 again hits the
    float32 pages and decodes what the first float32 run decoded; the cached pages of both
    formats show in the snapshot's blocks by format."""
    engine = make_engine(kv_cache_mb=8, kv_format="int8", kv_formats=("fp32",))
    prompt = tuple(random.Random(13).randrange(3, 2000) for _ in range(70))
    runs = []
    for fmt in ("", "fp32", "fp32", ""):
        tokens, finish = engine.submit(GenerationRequest(prompt, 6, GREEDY, kv_format=fmt)).collect(
            60
        )
        runs.append(([t.token_id for t in tokens], finish.usage.cached_tokens))
    assert runs[0][1] == 0 and runs[1][1] == 0, "a page of another format is not a hit"
    assert runs[2][1] >= 64 and runs[3][1] >= 64
    assert runs[1][0] == runs[2][0]
    wait_idle(engine)
    by_format = dict(engine.stats().kv_format_blocks)
    assert by_format["int8"] > 0 and by_format["float32"] > 0
    cache = engine._core.scheduler.cache
    pages = cache.pages()
    assert {p.fmt for p in pages} == {"", "float32"}
    units = sum(p.span for p in pages)  # float32 pages 4 blocks each (128 / 40 bytes), int8 1
    assert {p.span for p in pages} == {1, 4}
    n_layers = engine._core.scheduler.n_layers
    assert sum(by_format.values()) == units * 2 * n_layers == engine.stats().cached_blocks


def test_a_format_the_server_does_not_allow_is_refused(make_engine):
    engine = make_engine(kv_cache_mb=8, kv_format="int8", kv_formats=("int4",))
    for ask in ("fp32", "int2", "bf16"):
        with pytest.raises(InvalidRequestError, match="this server allows: auto, int8, int4") as e:
            engine.submit(GenerationRequest((5, 6, 7), 4, GREEDY, kv_format=ask))
        assert e.value.param == "kv_format"
    # the server's own by name, and auto, are its own format
    for ask in ("int8", "auto"):
        _, finish = engine.submit(GenerationRequest((5, 6, 7), 4, GREEDY, kv_format=ask)).collect(
            60
        )
        assert finish.finish_reason == "length"
    plain = make_engine(kv_cache_mb=8)
    with pytest.raises(InvalidRequestError, match="this server allows: auto, fp32"):
        plain.submit(GenerationRequest((5, 6, 7), 4, GREEDY, kv_format="int8"))


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"kv_layout": "paged"}, "--kv-formats with several formats needs --kv-layout dense"),
        ({"kv_formats": ("fp16",)}, "a float format other than the model's"),
    ],
)
def test_settings_that_hold_one_format_are_refused_at_start(default_model_dir, overrides, words):
    config = EngineConfig(
        model_cache_dir=str(default_model_dir.parent),
        kv_format="int8",
        kv_formats=overrides.pop("kv_formats", ("auto",)),
        **overrides,
    )
    refused_at_start(config, words)


def test_the_flag_is_read_as_a_list_and_unknown_names_are_refused():
    from veloxquant_mlx.config.settings import SettingsError, load_settings

    settings = load_settings(["--n-blocks", "64", "--kv-formats", " int4,auto ,int4"])
    assert settings.kv_format_list == ("int4", "auto")
    with pytest.raises(SettingsError, match="--kv-formats takes auto, fp16, bf16, fp32, int8"):
        load_settings(["--n-blocks", "64", "--kv-formats", "int8,int2"])


def test_rows_of_several_formats_preempted_come_back_and_finish(make_engine):
    """Six long requests of three formats in a pool that holds about half of them: rows are
    preempted (their pages cached in their own format) and resumed; every request ends with
    all its tokens and nothing leaks (the fixture checks the pool)."""
    engine = make_engine(
        n_blocks=900, kv_cache_mb=None, kv_format="int4", kv_formats=("int8", "fp32"),
        prefill_step=32,
    )  # fmt: skip
    rng = random.Random(14)
    asks = ["", "int8", "fp32", "fp32", "int8", ""]
    prompts = [tuple(rng.randrange(3, 2000) for _ in range(40)) for _ in asks]
    handles = [
        engine.submit(GenerationRequest(p, 100, GREEDY, kv_format=f))
        for p, f in zip(prompts, asks, strict=True)
    ]
    for h in handles:
        tokens, finish = h.collect(120)
        assert finish.finish_reason == "length" and len(tokens) == 100
    assert engine.stats().preemptions_total > 0
    wait_idle(engine)


def test_a_prompt_of_another_format_does_not_wait_for_a_shared_prefill():
    """A prompt whose next page another running request is prefilling waits for it (it will
    hit it), unless it is of another format (it would not): it is admitted at once. Scheduler
    only; int8 blocks, float32 pages 4 of them."""
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=4000))
    sched = Scheduler(pool, 2, 8, 64, prefix_caching=True, prefill_step=32, prefill_budget=32,
                      kv_format="int8", spans={"": 1, "int8": 1, "float32": 4})  # fmt: skip
    prompt = tuple(range(3, 203))

    def seq(rid: int, fmt: str) -> Seq:
        request = GenerationRequest(prompt, 4, GREEDY, kv_format=fmt)
        return Seq(RequestHandle(rid, request), list(prompt), len(prompt))

    first = seq(1, "")
    sched.waiting.append(first)
    sched.schedule()  # admitted, its first chunk planned
    same, other = seq(2, ""), seq(3, "float32")
    sched.waiting.extend([same, other])
    sched.schedule()
    assert other in sched.running and same not in sched.running
    assert other.n_blocks == 4 * -(-(len(prompt) + 1) // 16)
    for s in list(sched.running):
        sched.finish(s)
    sched.waiting.clear()
    assert pool.stats.blocks_in_use() == 0


def test_a_format_with_no_row_left_gives_its_memory_back(make_engine):
    """Once the last float32 row leaves, the float32 store's working set is dropped while
    int8 rows go on decoding."""
    engine = make_engine(kv_cache_mb=8, kv_format="int8", kv_formats=("fp32",))
    long = engine.submit(GenerationRequest(tuple(range(5, 25)), 60, GREEDY))
    short = engine.submit(GenerationRequest(tuple(range(30, 50)), 3, GREEDY, kv_format="fp32"))
    short.collect(60)
    stores = engine._core.runner.kv.stores
    seen_after = []
    while not long.done:
        seen_after.append(stores["float32"].rows)
    assert long.collect(60)[1].finish_reason == "length"
    assert seen_after and seen_after[-1] == 0
