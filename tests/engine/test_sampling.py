"""The batched sampler against mlx_lm's per-row filters, penalties and bias, and its draws."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from veloxquant_mlx.engine.request.host_draw import gumbel_noise, host_draw
from veloxquant_mlx.engine.request.logit_filters import (
    bitmask_to_allowed,
    filter_logits,
    host_rank_cut,
)
from veloxquant_mlx.engine.request.sampling import WINDOW, BatchSampler, RowSampling
from veloxquant_mlx.engine.types import SamplingParams

VOCAB = 97


def logprobs_of(rows: int, seed: int) -> mx.array:
    logits = mx.random.normal((rows, VOCAB), key=mx.random.key(seed)) * 3
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def stock_filter(row: mx.array, p: SamplingParams) -> mx.array:
    """mlx_lm's make_sampler chain for one row: top_p, min_p, top_k."""
    if 0.0 < p.top_p < 1.0:
        row = apply_top_p(row, p.top_p)
    if p.min_p > 0.0:
        row = apply_min_p(row, p.min_p)
    if p.top_k > 0:
        row = apply_top_k(row, p.top_k)
    return row


row_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]),
    top_k=st.sampled_from([0, 1, 5, 50]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
)


@settings(max_examples=40, deadline=None)
@given(params=st.lists(row_params, min_size=1, max_size=6), seed=st.integers(0, 2**31))
def test_each_rows_filters_keep_what_mlx_lms_keep(params, seed):
    """One pass over rows with different top_p / min_p / top_k keeps, per row, exactly the
    tokens mlx_lm's filters keep for that row alone (greedy rows are left whole)."""
    lp = logprobs_of(len(params), seed)
    sampler = BatchSampler([RowSampling(p, VOCAB) for p in params], VOCAB)
    if not sampler.sampled:
        return
    on_device = filter_logits(lp, *args_of(sampler), "sort" if sampler.uses_sort else "")
    cut = host_rank_cut(lp, sampler.top_p, sampler.top_k)  # the CPU's way: sorted by numpy
    on_host = filter_logits(lp, *args_of(sampler), "host", True, cut)
    for ours in (np.isfinite(np.array(on_device)), np.isfinite(np.array(on_host))):
        for i, p in enumerate(params):
            expected = np.ones(VOCAB, bool)
            if not p.greedy:
                expected = np.isfinite(np.array(stock_filter(lp[i : i + 1], p)))[0]
            assert (ours[i] == expected).all(), (i, p)


@settings(max_examples=40, deadline=None)
@given(
    params=st.lists(row_params, min_size=1, max_size=6),
    seed=st.integers(0, 2**31),
    levels=st.sampled_from([0, 5, 40]),
    dtype=st.sampled_from([mx.bfloat16, mx.float16]),
    vocab=st.sampled_from([VOCAB, 5000]),
)
@example(  # -0 and +0 at the top_k boundary: one value, two bit patterns (found by this test)
    params=[SamplingParams(0.0), SamplingParams(0.5, top_k=50), SamplingParams(0.0)],
    seed=0,
    levels=5,
    dtype=mx.bfloat16,
    vocab=VOCAB,
)
def test_the_histogram_cut_keeps_what_the_sort_keeps(params, seed, levels, dtype, vocab):
    """16-bit logits (a GPU model's): the sort-free top_p / top_k cut keeps exactly the sorted
    cut's tokens, ties (few distinct values: ``levels``; -0 and +0 among them), masked tokens
    (-inf) and negative values included."""
    logits = mx.random.normal((len(params), vocab), key=mx.random.key(seed)) * 4
    if levels:
        logits = mx.round(logits * levels / 8) * 8 / levels
    logits = mx.where(mx.arange(vocab) % 11 == 3, -mx.inf, logits).astype(dtype)
    sampler = BatchSampler([RowSampling(p, vocab) for p in params], vocab)
    if not sampler.sampled or not sampler.uses_sort:
        return
    by_sort = filter_logits(logits, *args_of(sampler), "sort")
    by_histogram = filter_logits(logits, *args_of(sampler), "histogram", sampler.uses_top_k)
    assert np.array_equal(np.isfinite(np.array(by_sort.astype(mx.float32))),
                          np.isfinite(np.array(by_histogram.astype(mx.float32))))  # fmt: skip


def test_a_seeded_draw_is_the_same_by_histogram_or_sort():
    params = [
        SamplingParams(0.8, top_p=0.9, top_k=30, seed=5),
        SamplingParams(1.0, top_p=0.5, seed=6),
    ]
    logits = (mx.random.normal((2, 3000), key=mx.random.key(1)) * 3).astype(mx.bfloat16)
    tokens = []
    for cut in ("sort", "histogram"):
        sampler = BatchSampler([RowSampling(p, 3000) for p in params], 3000, cut=cut)
        tokens.append([sampler.draw(logits).tokens.tolist() for _ in range(5)])
    assert tokens[0] == tokens[1]


@settings(max_examples=40, deadline=None)
@given(
    params=st.lists(row_params, min_size=1, max_size=6),
    seed=st.integers(0, 2**31),
    levels=st.sampled_from([0, 3, 40]),
    dtype=st.sampled_from([mx.float32, mx.bfloat16]),
    vocab=st.sampled_from([VOCAB, 5000]),
    spread=st.sampled_from([0.3, 3.0]),
)
@example(  # a row sorted for top_k whose min_p floor is above its top_k cut
    params=[SamplingParams(1.0, top_k=50, min_p=0.3), SamplingParams(0.7, top_p=0.5)],
    seed=1,
    levels=0,
    dtype=mx.float32,
    vocab=5000,
    spread=3.0,
)
def test_the_hosts_draw_gives_the_sorted_cuts_tokens(params, seed, levels, dtype, vocab, spread):
    """The CPU's draw (``host_draw``: top_p checked for the drawn token alone, a row sorted only
    where that token may be cut) gives the tokens of the device's sorted cut (``filter_logits``)
    with the same noise, step after step with the rows' keys: ties, masked tokens and flat rows
    (where top_p cuts most draws) included."""
    logits = mx.random.normal((len(params), vocab), key=mx.random.key(seed)) * spread
    if levels:
        logits = mx.round(logits * levels) / levels
    logits = mx.where(mx.arange(vocab) % 13 == 4, -mx.inf, logits).astype(dtype)
    seeded = [dataclasses.replace(p, seed=seed + i) for i, p in enumerate(params)]
    samplers = [BatchSampler([RowSampling(p, vocab) for p in seeded], vocab) for _ in range(2)]
    if not samplers[0].sampled:
        return
    on_device, on_host = [], []
    for step in range(4):
        step_logits = mx.roll(logits, step, axis=-1)
        for sampler, out, host in ((samplers[0], on_device, False), (samplers[1], on_host, True)):
            assert sampler.keys is not None
            args = (step_logits, sampler.keys, sampler.inv_temp, sampler.top_p, sampler.top_k)
            if host:
                tokens, sampler.keys = host_draw(*args, sampler.min_p, sampler.uses_min_p)
            else:
                tokens, sampler.keys = sorted_draw(step_logits, sampler)
            out.append(np.array(tokens).tolist())
    assert on_host == on_device


def sorted_draw(logits: mx.array, sampler: BatchSampler) -> tuple[np.ndarray, mx.array]:
    """The draw ``host_draw`` must equal: every sampled row cut by the device's sort
    (``filter_logits``, min_p too), tempered, plus the host's noise of the row's step key, its
    argmax; greedy rows the argmax."""
    assert sampler.keys is not None
    kept = filter_logits(
        logits, sampler.top_p, sampler.top_k, sampler.min_p, sampler.uses_min_p, "sort"
    )
    pairs = mx.vmap(mx.random.split)(sampler.keys)
    values, noise_keys = np.array(kept.astype(mx.float32)), np.array(pairs[:, 1])
    t = np.array(sampler.inv_temp)[:, 0]
    tokens = np.array(mx.argmax(logits, axis=-1))
    for i in np.flatnonzero(t > 0):
        tokens[i] = (values[i] * t[i] + gumbel_noise(noise_keys[i], values.shape[-1])).argmax()
    return tokens, pairs[:, 0]


def test_the_hosts_noise_is_gumbel_and_the_keys_own():
    """``gumbel_noise``: finite, the standard Gumbel's mean (Euler's 0.5772) and variance
    (pi^2 / 6) over 200,000 values, a function of the key alone."""
    key = np.array([7, 11], dtype=np.uint32)
    g = gumbel_noise(key, 200_000)
    assert g.dtype == np.float32 and np.isfinite(g).all()
    assert abs(g.mean() - 0.5772) < 0.01 and abs(g.var() - np.pi**2 / 6) < 0.03
    assert np.array_equal(g[:50], gumbel_noise(key, 50))
    assert not np.array_equal(g[:50], gumbel_noise(np.array([7, 12], dtype=np.uint32), 50))


def test_the_hosts_draw_sorts_only_rows_whose_token_top_p_may_cut(monkeypatch):
    """Peaked rows (top_p keeps the drawn token by a wide margin) are not sorted; flat rows
    whose drawn token is cut are, and then draw from the kept tokens."""
    from veloxquant_mlx.engine.request import host_draw as module

    sorted_rows = []
    cut = module.row_rank_cut
    monkeypatch.setattr(module, "row_rank_cut", lambda *a: sorted_rows.append(1) or cut(*a))
    peaked = mx.array([[8.0, 0.0] + [-4.0] * (VOCAB - 2)] * 4)
    rows = [RowSampling(SamplingParams(0.7, top_p=0.9, seed=i), VOCAB) for i in range(4)]
    sampler = BatchSampler(rows, VOCAB)
    assert np.array(sampler.draw(peaked).tokens).tolist() == [0, 0, 0, 0]
    assert not sorted_rows
    # top_p 0.1 keeps the top 10 of 97 near-equal tokens: most draws are cut
    flat = mx.broadcast_to(mx.arange(VOCAB) * 1e-3, (64, VOCAB))
    rows = [RowSampling(SamplingParams(1.0, top_p=0.1, seed=i), VOCAB) for i in range(64)]
    tokens = np.array(BatchSampler(rows, VOCAB).draw(flat).tokens)
    assert len(sorted_rows) > 32
    one = (mx.array([[0.1]]), mx.array([[0]]), mx.array([[0.0]]))
    kept = np.flatnonzero(np.array(filter_logits(flat[:1], *one, False, "sort")) > -np.inf)
    assert len(kept) == 10 and np.isin(tokens, kept).all() and len(set(tokens.tolist())) > 3


def args_of(sampler: BatchSampler) -> tuple:
    return (sampler.top_p, sampler.top_k, sampler.min_p, sampler.uses_min_p)


def test_penalties_and_bias_match_mlx_lms_processors_row_by_row():
    rng = np.random.default_rng(3)
    settings_ = [
        SamplingParams(0.0, repetition_penalty=1.3, logit_bias=((5, 4.0), (9, -2.0))),
        SamplingParams(1.0, presence_penalty=0.7, frequency_penalty=0.4),
        SamplingParams(1.0),  # no processors: untouched
        SamplingParams(0.7, repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.5),
    ]
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (3, 40, 10, 25)]
    rows = [RowSampling(p, VOCAB) for p in settings_]
    for row, prompt in zip(rows, prompts, strict=True):
        row.start_window(prompt, VOCAB)
    sampler = BatchSampler(rows, VOCAB)
    contexts = [list(p) for p in prompts]
    for step in range(3):
        logits = mx.random.normal((4, VOCAB), key=mx.random.key(step))
        inputs = None
        if step:
            fed = rng.integers(0, VOCAB, 4).tolist()
            inputs = mx.array(fed, dtype=mx.uint32)
            for c, t in zip(contexts, fed, strict=True):
                c.append(t)
        ours = logits
        if sampler.bias is not None:
            r, t, v = sampler.bias
            ours = ours.at[r, t].add(v)
        ours = sampler._penalize(ours, inputs)
        for i, p in enumerate(settings_):
            row = logits[i : i + 1]
            for processor in make_logits_processors(
                logit_bias=dict(p.logit_bias) or None,
                repetition_penalty=None if p.repetition_penalty == 1.0 else p.repetition_penalty,
                presence_penalty=p.presence_penalty or None,
                frequency_penalty=p.frequency_penalty or None,
            ):
                row = processor(mx.array(contexts[i]), row)
            assert np.allclose(np.array(ours[i]), np.array(row[0]), atol=1e-5), (step, i)
    assert sampler.window is not None and sampler.window.shape == (4, WINDOW)


def test_a_seeded_row_draws_the_same_alone_and_beside_others_across_steps():
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=42)

    def run(others: list[SamplingParams]) -> list[int]:
        rows: list[RowSampling | None] = [RowSampling(seeded, VOCAB)]
        rows += [RowSampling(p, VOCAB) for p in others]
        sampler = BatchSampler(rows, VOCAB)
        out = []
        for step in range(12):
            base = logprobs_of(1, 100 + step)
            logits = mx.concatenate([base] + [logprobs_of(1, step) for _ in others])
            out.append(int(sampler.draw(logits).tokens[0].item()))
            if step == 5:  # the row set changes: keys go back to the rows and on
                sampler.release()
                sampler = BatchSampler(rows, VOCAB)
            if step == 8 and others:  # a row leaves (a hole), one joins: carried, not copied
                rows[1] = None
                rows.append(RowSampling(SamplingParams(0.8, seed=5), VOCAB))
                others = [*others, others[0]]
                sampler = BatchSampler(rows, VOCAB, previous=sampler)
        return out

    alone = run([])
    assert alone == run([SamplingParams(1.0, seed=1), SamplingParams(0.0), SamplingParams(0.3)])
    assert len(set(alone)) > 1
    other = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=43)
    rows = [RowSampling(other, VOCAB)]
    sampler = BatchSampler(rows, VOCAB)
    assert [int(sampler.draw(logprobs_of(1, 100 + s)).tokens[0].item()) for s in range(12)] != alone


@pytest.mark.parametrize(("top_p", "kept"), [(1.0, 4), (0.85, 2)])
def test_draws_follow_the_tempered_distribution_and_greedy_rows_take_the_argmax(top_p, kept):
    """4,000 rows of one 4-token distribution, each with its own key: the draws' frequencies
    are softmax(logits / temperature) over the tokens top_p keeps (of softmax(logits): 0.64,
    0.24, 0.09, 0.03, so 0.85 keeps two) within a few standard errors."""
    logits = mx.array([[2.0, 1.0, 0.0, -1.0] + [-1e9] * (VOCAB - 4)])
    n = 4000
    params = [SamplingParams(temperature=0.5, top_p=top_p, seed=i) for i in range(n)]
    rows = [RowSampling(p, VOCAB) for p in params]
    rows.append(RowSampling(SamplingParams(temperature=0.0), VOCAB))
    drawn = BatchSampler(rows, VOCAB).draw(mx.repeat(logits, n + 1, axis=0))
    tokens = np.array(drawn.tokens)
    assert tokens[-1] == 0
    freq = np.bincount(tokens[:n], minlength=VOCAB)[:4] / n
    want = np.exp(np.array([2.0, 1.0, 0.0, -1.0]) / 0.5)
    want[kept:] = 0.0
    want /= want.sum()
    assert np.abs(freq - want).max() < 4 * np.sqrt(want * (1 - want) / n).max()
    assert (tokens < kept).all()


def test_logprobs_are_the_drawn_tokens_and_the_top_k_most_likely_first():
    lp = logprobs_of(3, 5)
    rows = [RowSampling(SamplingParams(0.0), VOCAB), None, RowSampling(SamplingParams(1.0), VOCAB)]
    drawn = BatchSampler(rows, VOCAB, top_logprobs=4).draw(lp)
    tokens = np.array(drawn.tokens)
    full = np.array(lp)
    assert drawn.token_logprobs is not None and drawn.top_ids is not None
    assert np.allclose(np.array(drawn.token_logprobs), full[np.arange(3), tokens], atol=1e-5)
    ids = np.array(drawn.top_ids)
    assert (ids == np.argsort(-full, axis=-1)[:, :4]).all()
    assert tokens[0] == ids[0, 0]


def test_a_grammar_bitmask_unpacks_to_the_allowed_tokens():
    bits = np.zeros((2, (VOCAB + 31) // 32), dtype=np.int32)
    allowed = [0, 31, 32, 63, 96]
    for t in allowed:
        bits[0, t // 32] |= np.int32(1 << (t % 32)) if t % 32 != 31 else np.int32(-(2**31))
    bits[1] = -1
    mask = np.array(bitmask_to_allowed(bits, VOCAB))
    assert mask.shape == (2, VOCAB)
    assert np.flatnonzero(mask[0]).tolist() == allowed
    assert mask[1].all()


def test_top_k_at_or_past_the_vocabulary_is_refused():
    for k in (VOCAB, VOCAB + 1):
        try:
            RowSampling(SamplingParams(1.0, top_k=k), VOCAB)
        except ValueError as exc:
            assert "top_k" in str(exc)
        else:
            raise AssertionError("accepted")


def test_an_engine_with_the_histogram_cut_draws_the_sort_engines_tokens(
    default_model_dir, monkeypatch
):
    """``--sampling-cut histogram`` end to end: a bfloat16 model (16-bit logits) on this CPU
    with the draw on the device, as on a GPU (a CPU draws every sampled row on the host, which
    takes no cut by histogram: ``HOST_DRAW`` off here), seeded top_p / top_k requests alone and
    batched give the sort engine's tokens, and the pool ends all free."""
    from tests.engine.conftest import assert_engine_all_free, wait_idle
    from veloxquant_mlx.engine.config import EngineConfig
    from veloxquant_mlx.engine.hosts.thread import Engine
    from veloxquant_mlx.engine.request import logit_filters, sampling
    from veloxquant_mlx.engine.types import GenerationRequest

    traced = []
    keys = logit_filters.histogram_keys
    monkeypatch.setattr(logit_filters, "histogram_keys", lambda *a: traced.append(1) or keys(*a))
    monkeypatch.setattr(sampling, "HOST_DRAW", False)
    sampling._compiled_draw.cache_clear()
    prompt = tuple(range(5, 40))
    params = [SamplingParams(0.9, top_p=0.9, seed=s) for s in range(4)]
    params.append(SamplingParams(0.7, top_p=0.8, top_k=40, seed=9))
    got = {}
    for cut in ("sort", "histogram"):
        config = EngineConfig(model_cache_dir=str(default_model_dir.parent), kv_cache_mb=32,
                              dtype="bfloat16", sampling_cut=cut)  # fmt: skip
        engine = Engine(config).start()
        try:
            engine.wait_ready(120)
            alone = engine.submit(GenerationRequest(prompt, 12, params[0])).collect(60)[0]
            handles = [engine.submit(GenerationRequest(prompt, 12, p)) for p in params]
            got[cut] = [[t.token_id for t in alone]] + [
                [t.token_id for t in h.collect(60)[0]] for h in handles
            ]
            wait_idle(engine)
            assert_engine_all_free(engine)
        finally:
            engine.shutdown(10)
    sampling._compiled_draw.cache_clear()
    assert traced, "the histogram engine's draws went through the histogram cut"
    assert got["histogram"] == got["sort"]
    assert got["sort"][0] == got["sort"][1]  # alone and batched
