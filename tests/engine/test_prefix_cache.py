"""Automatic prefix caching on the real engine: a hit changes no token, is reported in
``usage.cached_tokens``, hits through a previous answer, yields to pressure (evicted before
anyone is refused), and shrink and reset never take a block a request holds."""

from __future__ import annotations

import random
import threading

import pytest

from tests.engine.conftest import wait_idle
from veloxquant_mlx.engine.hosts.thread import Engine
from veloxquant_mlx.engine.loop.prefix_cache import CACHE_OWNER
from veloxquant_mlx.engine.types import FinishEvent, GenerationRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0)
BS = 16  # EngineConfig's default block size


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 2000) for _ in range(n)]


def run(engine: Engine, prompts: list[list[int]], max_tokens: int = 12) -> list[tuple]:
    """Submit all at once; (token ids, cached tokens, finish reason, logprobs) of each."""
    handles = [
        engine.submit(GenerationRequest(tuple(p), max_tokens, GREEDY, logprobs=True))
        for p in prompts
    ]
    out = []
    for h in handles:
        tokens, finish = h.collect(120)
        assert isinstance(finish, FinishEvent)
        out.append(
            (
                [t.token_id for t in tokens],
                finish.usage.cached_tokens,
                finish.finish_reason,
                [t.logprob for t in tokens],
            )
        )
    return out


# "fused": the paged layout attending through its tables (kv/paged_attention.py)
LAYOUTS = {
    "dense": {"kv_layout": "dense"},
    "paged": {"kv_layout": "paged"},
    "fused": {"kv_layout": "paged", "paged_attention": "fused"},
}


@pytest.mark.parametrize("layout", ["dense", "paged", "fused"])
def test_hits_give_the_same_greedy_tokens_alone_and_batched(make_engine, layout):
    rng = random.Random(5)
    shared = words(rng, 3 * BS + 5)  # the shared part ends mid-block
    first = [shared + words(rng, 7)]
    # then alone (one hit), then batched with a miss and a hit that is the whole prompt but one
    later = [[shared + words(rng, 9)], [shared + words(rng, 4), words(rng, 30), shared[:33]]]
    cached = make_engine(kv_cache_mb=32, **LAYOUTS[layout], prefill_step=32)
    plain = make_engine(kv_cache_mb=32, **LAYOUTS[layout], prefill_step=32, prefix_caching=False)
    got = [run(cached, first)] + [run(cached, batch) for batch in later]
    want = [run(plain, first)] + [run(plain, batch) for batch in later]
    assert [[r[0] for r in b] for b in got] == [[r[0] for r in b] for b in want]
    # the cached KV is the KV: the sampled tokens' logprobs agree too (fp32)
    for b_got, b_want in zip(got, want, strict=True):
        for r_got, r_want in zip(b_got, b_want, strict=True):
            assert r_got[3] == pytest.approx(r_want[3], abs=1e-4)
    assert [[r[1] for r in b] for b in want] == [[0], [0], [0, 0, 0]]
    # full blocks of the shared part, and at least the last prompt token left to prefill
    assert [[r[1] for r in b] for b in got] == [[0], [3 * BS], [3 * BS, 0, 2 * BS]]
    stats = cached.stats()
    assert stats.prefix_caching and stats.prefix_hits_total == 8 * BS
    assert stats.prefix_queries_total == sum(len(p) for b in [first, *later] for p in b)
    assert stats.cached_blocks > 0 and stats.evictable_blocks == stats.cached_blocks


@pytest.mark.parametrize("layout", ["dense", "paged", "fused"])
def test_the_next_turn_hits_through_the_previous_answer(make_engine, layout):
    engine = make_engine(kv_cache_mb=32, **LAYOUTS[layout])
    plain = make_engine(kv_cache_mb=32, **LAYOUTS[layout], prefix_caching=False)
    rng = random.Random(8)
    prompt = words(rng, 20)
    [(answer, cached, reason, _)] = run(engine, [prompt], max_tokens=40)
    assert (cached, reason) == (0, "length") and len(answer) == 40
    turn2 = prompt + answer + words(rng, 6)
    [(answer2, cached2, _, _)] = run(engine, [turn2], max_tokens=12)
    # the answer's full pages were cached when it ended: 20 + 40 tokens -> 3 blocks (only 1
    # if the prompt alone were cached)
    assert cached2 == 3 * BS
    turn3 = turn2 + answer2 + words(rng, 3)
    [(tokens3, cached3, _, _)] = run(engine, [turn3])
    assert cached3 == (len(turn2) + len(answer2)) // BS * BS
    assert run(plain, [turn2], max_tokens=12)[0][0] == answer2
    assert run(plain, [turn3])[0][0] == tokens3


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_answers_cached_from_a_batch_change_no_token(make_engine, layout):
    """Rows that leave a batch of four (dense: from their slots of the working set, while the
    others go on decoding) are cached; their next turns, batched again, decode as uncached."""
    engine = make_engine(kv_cache_mb=32, **LAYOUTS[layout])
    plain = make_engine(kv_cache_mb=32, **LAYOUTS[layout], prefix_caching=False)
    rng = random.Random(11)
    prompts = [words(rng, 10 + 7 * i) for i in range(4)]
    handles = [
        engine.submit(GenerationRequest(tuple(p), 20 + 9 * i, GREEDY))
        for i, p in enumerate(prompts)
    ]
    answers = [[t.token_id for t in h.collect(120)[0]] for h in handles]
    turns = [p + a + words(rng, 5) for p, a in zip(prompts, answers, strict=True)]
    got = run(engine, turns)
    whole = [len(p) + len(a) for p, a in zip(prompts, answers, strict=True)]
    assert [r[1] for r in got] == [n // BS * BS for n in whole]
    assert [r[0] for r in got] == [r[0] for r in run(plain, turns)]
    wait_idle(engine)


def test_answers_are_not_cached_when_turned_off(make_engine):
    engine = make_engine(kv_cache_mb=32, prefix_cache_answers="off")
    rng = random.Random(8)
    prompt = words(rng, 20)
    [(answer, _, _, _)] = run(engine, [prompt], max_tokens=40)
    [(_, cached2, _, _)] = run(engine, [prompt + answer + words(rng, 6)], max_tokens=4)
    assert cached2 == 1 * BS  # the prompt's one full page only


def test_cached_blocks_are_evicted_before_anyone_is_refused(make_engine):
    # 4 layers x 2 streams: a 64-token request holds 8 blocks per layer and stream (+1 to grow)
    engine = make_engine(n_blocks=2 * 4 * 2 * 12, max_running=1)
    rng = random.Random(2)
    for _ in range(6):  # six different prompts fill the cache
        run(engine, [words(rng, 70)], max_tokens=4)
    before = engine.stats()
    assert before.cached_blocks > 0 and before.evictable_blocks == before.cached_blocks
    big = words(rng, 12 * BS - 20)  # needs nearly the whole pool
    [(tokens, _, reason, _)] = run(engine, [big], max_tokens=8)
    assert reason == "length" and len(tokens) == 8
    after = engine.stats()
    assert after.prefix_evictions_total > before.prefix_evictions_total
    assert after.rejections_total == {} and after.preemptions_total == 0


def test_pressure_evicts_a_conversation_from_its_tail_so_its_start_still_hits(make_engine):
    # 24 pages; a 20-page conversation, then a 10-page stranger takes 6 of its pages
    engine = make_engine(n_blocks=2 * 4 * 24, max_running=1)
    rng = random.Random(8)
    convo = words(rng, 20 * BS)
    run(engine, [convo], max_tokens=4)
    run(engine, [words(rng, 10 * BS - 6)], max_tokens=4)
    assert engine.stats().prefix_evictions_total > 0
    [(_, cached, _, _)] = run(engine, [convo + words(rng, 5)], max_tokens=4)
    # the pages it lost were its last ones: what is left is a prefix a lookup reaches
    assert 10 * BS <= cached < 20 * BS


def test_shrink_retires_evictable_cached_blocks_never_held_ones(make_engine):
    engine = make_engine(n_blocks=2 * 400)
    rng = random.Random(4)
    shared = words(rng, 4 * BS + 3)
    run(engine, [shared], max_tokens=4)
    cached = engine.stats().cached_blocks
    assert cached > 0
    # a request holding the shared pages decodes while the pool is shrunk to nothing free
    h = engine.submit(GenerationRequest(tuple(shared + words(rng, 5)), 40, GREEDY))
    first = next(e for e in h.events(30))
    assert not isinstance(first, FinishEvent)
    retired = engine.shrink("kv", 0)
    assert retired > 0
    held = engine.stats()
    assert held.cached_blocks == 4 * 2 * 4 and held.evictable_blocks == 0  # its 4 pages stay
    _, finish = h.collect(60)  # it ends (length, or capacity_reduced when it must grow)
    assert finish.finish_reason in ("length", "error")
    wait_idle(engine)
    pool_owners = engine.pool.owner_block_counts()
    assert set(pool_owners) <= {CACHE_OWNER}


def test_reset_under_load_changes_no_token(make_engine):
    rng = random.Random(6)
    shared = words(rng, 3 * BS)
    prompts = [shared + words(rng, 3 + i) for i in range(12)]
    plain = make_engine(kv_cache_mb=32, prefix_caching=False)
    want = [r[0] for r in run(plain, prompts)]
    engine = make_engine(kv_cache_mb=32, max_running=4)
    stop = threading.Event()
    freed: list[int] = []

    def resets() -> None:
        for _ in range(400):  # bounded: ends by itself
            if stop.is_set():
                return
            freed.append(engine.reset_prefix_cache())

    t = threading.Thread(target=resets)
    t.start()
    try:
        got = [r[0] for r in run(engine, prompts)]
    finally:
        stop.set()
        t.join(30)
    assert got == want
    assert len(freed) > 0


def test_auto_caches_answers_in_the_dense_layout_only_while_few_requests_run():
    from veloxquant_mlx.engine.model.choices import ANSWERS_UP_TO, answers_up_to

    assert answers_up_to("auto", keeps_pages=True) is None  # paged: always (no copy)
    assert answers_up_to("auto", keeps_pages=False) == ANSWERS_UP_TO
    assert answers_up_to("on", keeps_pages=False) is None
    assert answers_up_to("off", keeps_pages=True) == 0
    with pytest.raises(ValueError):
        answers_up_to("sometimes", keeps_pages=True)


def test_a_busy_dense_engine_does_not_copy_answers_out(make_engine):
    """Over the limit of running requests, a leaving row's generated pages are not cached
    (the next turn hits through its prompt only); under it, they are."""
    engine = make_engine(kv_cache_mb=32, max_running=8)
    engine._core.scheduler.tables.answers_up_to = 2  # the limit, small enough to test
    rng = random.Random(12)
    prompts = [words(rng, 20) for _ in range(4)]
    handles = [engine.submit(GenerationRequest(tuple(p), 40, GREEDY)) for p in prompts]
    answers = [[t.token_id for t in h.collect(120)[0]] for h in handles]
    wait_idle(engine)
    # all four end in one step, one after the other: the first two while 4 and 3 run (their
    # prompt's one full page is cached), the last two while 2 and 1 do (answers too)
    got = run(engine, [p + a + [7] for p, a in zip(prompts, answers, strict=True)], 2)
    assert [r[1] for r in got] == [BS, BS, 3 * BS, 3 * BS]


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_prompts_that_arrive_together_with_one_prefix_prefill_it_once(make_engine, layout):
    """Four sessions start at once with the same long system prompt: the first prefills it,
    the others wait for its pages (admitted once it is in) and hit them, with the same tokens
    as without caching."""
    engine = make_engine(kv_cache_mb=32, **LAYOUTS[layout], prefill_step=64)
    plain = make_engine(kv_cache_mb=32, **LAYOUTS[layout], prefill_step=64, prefix_caching=False)
    rng = random.Random(13)
    system = words(rng, 300)
    prompts = [system + words(rng, 10) for _ in range(4)]
    got = run(engine, prompts)
    assert [r[1] for r in got] == [0] + [300 // BS * BS] * 3
    assert [r[0] for r in got] == [r[0] for r in run(plain, prompts)]
    stats = engine.stats()
    assert stats.prefix_hits_total == 3 * (300 // BS * BS)


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_a_prompt_whose_first_token_is_its_last_caches_its_pages_without_decoding(
    make_engine, layout, monkeypatch
):
    """``max_tokens`` 1 (a cache warm-up, a classification): the prompt's pages are cached and
    its token is the same as a longer request's first; in the dense layout it never joins the
    batch, so no decode step runs for it (the paged layout writes its pages into the pool's
    blocks by joining)."""
    from veloxquant_mlx.engine.loop.runner import Runner

    steps: list[int] = []
    original = Runner.step

    def counted(self, max_block_id):
        steps.append(len([r for r in self.rows if r is not None]))
        return original(self, max_block_id)

    monkeypatch.setattr(Runner, "step", counted)
    engine = make_engine(kv_cache_mb=32, **LAYOUTS[layout])
    rng = random.Random(11)
    prompt = words(rng, 5 * BS + 3)
    [(one, cached, reason, _)] = run(engine, [prompt], max_tokens=1)
    assert (len(one), cached, reason) == (1, 0, "length")
    assert (steps == []) == (layout == "dense"), steps
    # the next turn finds them, and is the same token as a request that goes on decoding
    [(two, cached2, _, _)] = run(engine, [[*prompt, 7]], max_tokens=1)
    assert cached2 == 5 * BS
    assert (steps == []) == (layout == "dense"), steps
    [(longer, _, _, _)] = run(engine, [[*prompt, 7]], max_tokens=6)
    assert longer[0] == two[0] and len(longer) == 6 and steps
    wait_idle(engine)


def test_caching_a_leaving_rows_answer_keeps_the_next_steps_writes_in_place(make_engine):
    """Dense layout: rows that leave while another decodes have their answers copied out of
    the working set; no step launched after that copies the working set (a copy still pending
    when a step writes the working set makes that write copy every layer's: MLX's peak memory
    over each launch without a join, the previous step done before it, stays under one
    layer's K and V; it was four, every layer copied, at each launch after a leave)."""
    import mlx.core as mx

    box: dict = {"ratios": []}

    def hook() -> None:  # engine thread, before each turn
        runner = box["engine"]._core.runner
        if "launch" in box:
            return
        box["launch"] = launch = runner.launch

        def measured(sampled) -> None:
            kv = runner.kv
            rows = sum(r is not None for r in runner.rows)
            joined, box["rows"] = rows > box.get("rows", 0), rows
            mx.synchronize()  # the previous step and the prefills done
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            launch(sampled)
            mx.synchronize()
            if kv.k and not joined:  # (a join writes its prompt's KV in with the launch)
                layer = kv.k[0].nbytes + kv.v[0].nbytes
                box["ratios"].append((mx.get_peak_memory() - base) / layer)

        runner.launch = measured

    engine = make_engine(kv_cache_mb=32, kv_layout="dense", step_hook=hook)
    box["engine"] = engine
    rng = random.Random(12)
    prompts = [words(rng, 600)] + [words(rng, 20 + 5 * i) for i in range(3)]
    limits = [120, 40, 56, 72]  # the three short ones leave while the first decodes
    handles = [
        engine.submit(GenerationRequest(tuple(p), n, GREEDY))
        for p, n in zip(prompts, limits, strict=True)
    ]
    for h in handles:
        _, finish = h.collect(120)
        assert isinstance(finish, FinishEvent) and finish.finish_reason == "length"
    assert engine.stats().cached_blocks >= 3 * (20 + 40) // BS  # the answers were cached
    assert len(box["ratios"]) > 100
    copies = [(i, round(r, 2)) for i, r in enumerate(box["ratios"]) if r > 0.2]
    assert max(box["ratios"]) < 0.5, copies


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_a_prompt_cancelled_mid_prefill_leaves_the_pages_it_wrote_cached(make_engine, layout):
    """An agent whose timeout ends a long prefill resends the prompt: the retry starts from the
    pages the cut prefill wrote (the dense layout keeps a copy of its prefill caches' pages;
    the paged one, which writes a prompt's blocks when it joins, writes them when it leaves),
    and gives the tokens a cold prefill gives."""
    box: dict = {}

    def hook() -> None:  # engine thread, before each turn
        engine, long = box.get("engine"), box.get("long")
        if engine is None or long is None or "cut" in box:
            return
        for seq in engine._core.scheduler.running:
            caches = None if seq.state is None else seq.state.caches
            if seq.handle is long and caches is not None and caches[0].offset >= 4 * BS:
                box["cut"] = caches[0].offset  # some chunks in, most to come
                engine.cancel(long)

    engine = make_engine(kv_cache_mb=32, step_hook=hook, prefill_step=32, prefill_budget=32,
                         idle_prefill_budget=32, **LAYOUTS[layout])  # fmt: skip
    box["engine"] = engine
    prompt = words(random.Random(21), 20 * BS + 3)
    box["long"] = engine.submit(GenerationRequest(tuple(prompt), 8, GREEDY))
    tokens, finish = box["long"].collect(120)
    assert isinstance(finish, FinishEvent) and finish.finish_reason == "cancelled", finish
    assert tokens == [] and box["cut"] < len(prompt) - 2 * BS
    [(again, cached, reason, _)] = run(engine, [prompt], max_tokens=8)
    assert box["cut"] // BS * BS <= cached < len(prompt), (box["cut"], cached)
    plain = make_engine(kv_cache_mb=32, prefix_caching=False, **LAYOUTS[layout])
    assert run(plain, [prompt], max_tokens=8)[0][0] == again and reason == "length"
