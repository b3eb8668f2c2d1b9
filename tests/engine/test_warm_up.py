"""Warm start: before the engine says it is ready it runs every batch size up to
``max_running``, a chunked prompt and a sampled request, and then nothing of it shows: no
counters, no cached pages, no held block, and the same tokens as an engine that did not warm up.
"""

from __future__ import annotations

import logging

from tests.conftest import assert_engine_all_free
from veloxquant_mlx.engine.loop.warmup import (
    NEXT_TURN,
    WARM_UP_ID,
    long_context,
    wanted,
    warm_up_waves,
)
from veloxquant_mlx.engine.types import GenerationRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def test_the_waves_cover_every_batch_size_and_a_chunked_prompt():
    waves = warm_up_waves(
        max_running=12, prefill_step=64, context_window=2048, vocab_size=2048, prefill_budget=48
    )
    sizes = [len(w) for w in waves]
    assert sizes[:5] == [1, 2, 4, 8, 12]
    lengths = [len(r.prompt_tokens) for w in waves for r in w]
    # one chunk of either width (the budget beside decoding, the step), and several
    assert 48 in lengths and 64 in lengths and 2 * 64 + 8 in lengths
    prompts = [r.prompt_tokens for w in waves for r in w if not r.sampling.greedy]
    assert prompts and all(0 < t < 2048 for p in prompts for t in p)
    decode = [r.prompt_tokens for w in waves[:5] for r in w]
    assert len(set(decode)) == len(decode)  # no prefix hit changes a shape
    # a window too short for the long prompts leaves them out
    short = warm_up_waves(max_running=2, prefill_step=64, context_window=100, vocab_size=50)
    assert max(len(r.prompt_tokens) for w in short for r in w) <= 100 - 3


def test_a_wave_decodes_rows_at_different_positions_beside_a_chunked_prompt():
    waves = warm_up_waves(max_running=6, prefill_step=64, context_window=2048, vocab_size=2048)
    ragged = [w for w in waves if len({len(r.prompt_tokens) for r in w}) > 2]
    assert sorted(len(w) for w in ragged) == [3, 7]  # 2 and max_running rows, plus the prompt
    for wave in ragged:
        *rows, prompt = wave
        assert len({len(r.prompt_tokens) for r in rows}) == len(rows)  # all different
        assert max(len(r.prompt_tokens) for r in rows) <= 8 + 15  # short, however many rows
        assert len(prompt.prompt_tokens) > 64 and all(r.max_tokens > 3 for r in rows)
    wide = warm_up_waves(max_running=1024, prefill_step=64, context_window=None, vocab_size=99)
    assert max(len(r.prompt_tokens) for w in wide for r in w if len(w) > 1000) <= 64 + 8


def test_with_padded_prefill_widths_every_bucketed_width_is_met():
    waves = warm_up_waves(
        max_running=2, prefill_step=256, context_window=4096, vocab_size=2048,
        prefill_budget=128, bucket=64,
    )  # fmt: skip
    lengths = {len(r.prompt_tokens) for w in waves for r in w}
    assert {64, 128, 192, 256} <= lengths


def test_auto_warms_up_on_a_gpu_only():
    assert wanted("on") and not wanted("off")
    assert wanted("auto") is False  # this suite runs MLX on a CPU


def test_a_warmed_engine_shows_nothing_of_it_and_decodes_the_same(make_engine, caplog):
    with caplog.at_level(logging.INFO, logger="veloxquant.engine"):
        warmed = make_engine(kv_cache_mb=32, warm_up="on", max_running=4, prefill_step=32)
    assert any("warmed up" in r.getMessage() for r in caplog.records)
    stats = warmed.stats()
    assert stats.requests_finished_total == {} and stats.prompt_tokens_total == 0
    assert stats.generated_tokens_total == 0 and stats.preemptions_total == 0
    assert stats.cached_blocks == 0 and stats.prefix_queries_total == 0
    assert warmed.pool is not None and warmed.pool.stats.blocks_in_use() == 0
    assert all(owner < WARM_UP_ID for owner in warmed.pool.owner_block_counts())
    cold = make_engine(kv_cache_mb=32, warm_up="off", max_running=4, prefill_step=32)
    prompt = tuple(range(5, 60))
    tokens = []
    for engine in (warmed, cold):
        handle = engine.submit(GenerationRequest(prompt, 12, GREEDY))
        events, finish = handle.collect(60)
        assert finish.finish_reason == "length"
        tokens.append([e.token_id for e in events])
    assert tokens[0] == tokens[1]
    assert_engine_all_free(warmed)


def test_a_warm_up_that_fails_refuses_to_start_in_one_line(default_model_dir, monkeypatch, caplog):
    """A shape the flags cannot run on this device (MLX 0.32's CUDA quantized_matmul refused
    one) fails the start with one line naming the warm-up, not at the first request. That
    cannot happen on this CPU, so a step's failure is stood in for."""
    import pytest

    from veloxquant_mlx.engine.hosts.thread import Engine, EngineConfig
    from veloxquant_mlx.engine.loop.runner import Runner

    def refuse(*_args):
        raise RuntimeError("[quantized_matmul] No implementation for problem shape\nsecond line")

    monkeypatch.setattr(Runner, "step", refuse)
    config = EngineConfig(model_cache_dir=str(default_model_dir.parent), warm_up="on")
    engine = Engine(config).start()
    try:
        with (
            caplog.at_level(logging.ERROR, logger="veloxquant.engine"),
            pytest.raises(Exception, match="warm-up's requests failed") as info,
        ):
            engine.wait_ready(120)
        assert "second line" not in str(info.value)
        lines = [r.getMessage() for r in caplog.records if "failed to load" in r.getMessage()]
        assert lines and "No implementation" in lines[0] and "\n" not in lines[0]
        assert not engine.alive
    finally:
        engine.shutdown(5)


def test_with_several_kv_formats_each_meets_every_batch_size_and_all_meet_together():
    waves = warm_up_waves(
        max_running=4, prefill_step=64, context_window=2048, vocab_size=2048,
        formats=("int4", "float32"),
    )  # fmt: skip
    for fmt in ("int4", "float32"):
        sizes = [len(w) for w in waves if {r.kv_format for r in w} == {fmt}]
        assert sizes == [1, 2, 4]
    together = [w for w in waves if len({r.kv_format for r in w}) == 3]
    assert len(together) == 1 and len(together[0]) == 4
    assert len({len(r.prompt_tokens) for r in together[0]}) == 4  # at different positions
    assert all(r.kv_format == "" for r in warm_up_waves(2, 64, 2048, 2048)[0])


def test_a_warmed_engine_with_several_formats_runs_them_and_is_left_free(make_engine):
    engine = make_engine(
        kv_cache_mb=16, warm_up="on", max_running=4, kv_format="int8", kv_formats=("fp32",)
    )
    stats = engine.stats()
    assert stats.requests_finished_total == {} and stats.cached_blocks == 0
    assert stats.kv_format_blocks == () or all(n == 0 for _, n in stats.kv_format_blocks)
    assert engine.pool is not None and engine.pool.stats.blocks_in_use() == 0
    _, finish = engine.submit(
        GenerationRequest(tuple(range(5, 40)), 6, GREEDY, kv_format="fp32")
    ).collect(60)
    assert finish.finish_reason == "length"


def test_the_long_conversation_is_cuda_only_by_default_and_bounded_by_window_and_pool():
    def fits(n: int) -> bool:
        return True

    assert long_context(0, 8192, fits) == 0
    assert long_context(4096, 32768, fits) == 4096
    assert long_context(4096, 2048, fits) == 2048 - NEXT_TURN - 3 - 1  # the window's
    assert long_context(8192, None, lambda n: n <= 3000) == 2048  # halved until it fits
    assert long_context(8192, None, lambda n: n <= 900) == 0  # too short to be worth it


def test_the_long_conversation_is_a_prompt_beside_a_decoding_row_then_its_next_turn():
    waves = warm_up_waves(4, 64, 8192, 2048, prefill_budget=32, conversation=3000)
    [beside] = [w for w in waves if any(len(r.prompt_tokens) == 3000 for r in w)]
    short, first = beside
    assert len(short.prompt_tokens) < 64 and short.max_tokens > first.max_tokens
    [(second,)] = [w for w in waves if any(len(r.prompt_tokens) == 3000 + NEXT_TURN for r in w)]
    assert second.prompt_tokens[:3000] == first.prompt_tokens  # the cached turn
    assert waves.index([second]) == waves.index(beside) + 1
    assert not any(
        len(r.prompt_tokens) >= 3000 for w in warm_up_waves(4, 64, 8192, 2048) for r in w
    )


def test_a_warm_up_with_a_long_conversation_finds_its_turn_cached_and_leaves_nothing(
    make_engine, caplog
):
    with caplog.at_level(logging.INFO, logger="veloxquant.engine"):
        engine = make_engine(
            kv_cache_mb=32, warm_up="on", warm_up_context=1500, max_running=4, prefill_step=256,
            prefix_caching=True,
        )  # fmt: skip
    [line] = [r.getMessage() for r in caplog.records if "warmed up" in r.getMessage()]
    # the second turn found the first turn's full pages (1,500 tokens: 93 pages of 16)
    assert "(1488 prompt tokens found cached)" in line, line
    stats = engine.stats()
    assert stats.cached_blocks == 0 and stats.prefix_queries_total == 0
    assert engine.pool is not None and engine.pool.stats.blocks_in_use() == 0
    assert_engine_all_free(engine)


def test_bucketed_prefill_attention_builds_its_shapes_before_ready(make_engine, caplog):
    """``--prefill-attention buckets``: the warm-up also runs every (queries, keys) bucket up
    to the context window (``kv.chunk_attention.warm_buckets``), then serves as before."""
    with caplog.at_level(logging.INFO, logger="veloxquant.engine"):
        engine = make_engine(
            kv_cache_mb=16, warm_up="on", max_running=2, prefill_step=128,
            prefill_attention="buckets",
        )  # fmt: skip
    [line] = [r.getMessage() for r in caplog.records if "warmed up" in r.getMessage()]
    # widths 64 and 128 x keys 256, 512, 768, ... 2,048, 2,560, ... 4,096, 5,120, ... 8,192
    # (the window): 2 x 16
    assert " and 32 of 32 prefill attention shapes " in line, line
    _, finish = engine.submit(GenerationRequest(tuple(range(5, 300)), 4, GREEDY)).collect(60)
    assert finish.finish_reason == "length"
    assert_engine_all_free(engine)


def test_the_waves_draw_through_each_combination_of_cuts_clients_send():
    """Each combination of cuts is its own compiled draw on a GPU: temperature alone, with
    top_p (what chat clients send), with min_p, and top_k (with penalties, logprobs) are met
    before ready, each beside another request (a batch's draw, not a lone row's)."""
    from veloxquant_mlx.engine.request.sampling import BatchSampler, RowSampling

    waves = warm_up_waves(4, 64, 2048, 2048)
    met = set()
    for wave in waves:
        sampled = [r for r in wave if not r.sampling.greedy]
        if sampled:
            assert len(sampled) >= 2
            s = BatchSampler([RowSampling(r.sampling, 2048) for r in sampled], 2048)
            met.add((s.uses_min_p, s.uses_sort, s.uses_top_k, s.penalized))
    assert {
        (False, False, False, False),
        (False, True, False, False),
        (True, False, False, False),
        (False, True, True, True),
    } <= met
