"""The prefill budget: a step carries at most ``prefill_budget`` prompt tokens while other
rows decode (so a long prompt arriving pauses their streams for one such step at a time), and
up to ``idle_prefill_budget`` while none does. Scheduler only (no model); the engine's streams
under a long prompt are ``benchmarks.stall_bench``'s."""

from __future__ import annotations

from tests.conftest import assert_pool_all_free
from veloxquant_mlx.engine.loop.scheduler import Scheduler
from veloxquant_mlx.engine.loop.seq import Seq
from veloxquant_mlx.engine.request.handle import RequestHandle
from veloxquant_mlx.engine.types import GenerationRequest, SamplingParams
from veloxquant_mlx.pool import BlockPoolAllocator, PoolConfig

LAYERS, BLOCK = 2, 16


def _seq(rid: int, n: int) -> Seq:
    request = GenerationRequest(tuple(range(3, 3 + n)), 8, SamplingParams())
    return Seq(RequestHandle(rid, request), list(request.prompt_tokens), n)


def _planned(sched: Scheduler) -> list[int]:
    """Prompt tokens each step prefills until every prompt is in (the runner's part done
    by hand: a row whose prompt completes decodes from the next step)."""
    widths = []
    while any(not s.decoding for s in sched.running) or sched.waiting:
        plan = sched.schedule()
        widths.append(sum(c.n for c in plan.chunks) + sum(len(s.tokens) for s in plan.together))
        sched.decoded([s for s in sched.running if s.decoding])
    return widths


def test_a_long_prompt_beside_a_decoding_row_goes_in_budget_sized_steps():
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK, n_blocks=2000))
    sched = Scheduler(pool, LAYERS, 8, 64, prefill_step=512, prefill_budget=128)
    running = _seq(1, 20)
    sched.waiting.append(running)
    assert _planned(sched) == [20]  # alone: the idle budget (2048) takes it whole
    sched.waiting.append(_seq(2, 1000))
    # beside a decoding row: 128 tokens a step, the last chunk the rest
    assert _planned(sched) == [128] * 7 + [1000 - 7 * 128]
    for seq in list(sched.running):
        sched.finish(seq)
    sched.waiting.append(_seq(3, 1000))
    assert _planned(sched) == [512, 488]  # nobody decodes: prefill_step-sized chunks
    for seq in list(sched.running):
        sched.finish(seq)
    assert_pool_all_free(pool)


def test_the_idle_budget_is_never_below_the_decoding_one():
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK, n_blocks=200))
    sched = Scheduler(pool, LAYERS, 8, 64, prefill_budget=4096, idle_prefill_budget=16)
    assert sched.idle_prefill_budget == 4096


def _grouped(rid: int, n: int, group: int) -> Seq:
    request = GenerationRequest(tuple(range(3, 3 + n)), 8, SamplingParams(), group=group)
    return Seq(RequestHandle(rid, request), list(request.prompt_tokens), n)


def _run_prefill(sched: Scheduler) -> None:
    sched.schedule()
    sched.decoded([s for s in sched.running if s.decoding])
    while any(not s.decoding for s in sched.running):
        sched.schedule()
        sched.decoded([s for s in sched.running if s.decoding])


def test_one_group_alone_takes_every_slot_and_gives_back_its_excess_when_another_waits():
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK, n_blocks=4000))
    sched = Scheduler(pool, LAYERS, 4, 64, prefill_step=512, prefill_budget=128)
    fat = [_grouped(i, 30, group=7) for i in range(1, 9)]  # 8 sequences of one request
    sched.waiting.extend(fat)
    _run_prefill(sched)
    assert [s.request_id for s in sched.running] == [1, 2, 3, 4]  # alone: all 4 slots
    plain = _seq(100, 20)
    sched.waiting.append(plain)
    plan = sched.schedule()
    # two groups: 2 slots each; the fat request's newest is preempted for the plain one
    assert [s.request_id for s in plan.preempted] == [4] and plain in plan.admitted
    assert [s.request_id for s in sched.waiting][:1] == [4]  # back at the head, passed over
    assert sorted(s.group for s in sched.running).count(7) == 3
    # the fat group's waiting sequences stay passed over while the plain one runs
    plan = sched.schedule()
    assert not plan.admitted and not plan.preempted
    sched.finish(plain)
    plan = sched.schedule()  # alone again: its next sequence takes the free slot
    assert [s.request_id for s in plan.admitted] == [4]
    for seq in [*sched.running, *sched.waiting]:
        sched.finish(seq)
    assert_pool_all_free(pool)


def test_a_group_of_many_prompts_gets_a_share_of_the_prefill_budget():
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK, n_blocks=8000))
    sched = Scheduler(pool, LAYERS, 16, 64, prefill_step=512, prefill_budget=128)
    decoding = _seq(1, 10)
    sched.waiting.append(decoding)
    _run_prefill(sched)  # one stream decodes: the 128-token budget applies
    sched.waiting.extend(_grouped(10 + i, 600, group=3) for i in range(6))
    sched.waiting.append(_seq(50, 600))  # a lone prompt of another client, behind them
    plan = sched.schedule()
    by = {c.seq.request_id: c.n for c in plan.chunks}
    # two groups pending: the six-prompt group spends 64, the lone prompt the rest
    assert sum(n for rid, n in by.items() if rid != 50) == 64 and by[50] == 64
    for seq in [*sched.running, *sched.waiting]:
        sched.finish(seq)
    assert_pool_all_free(pool)
