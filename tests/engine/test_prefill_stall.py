"""``--prefill-stall-ratio``: the prefill budget beside decoding rows moves so that a step
carrying prefill takes at most about that many times a decode-only step. The controller's
arithmetic on given gaps (``PrefillBudget``), and an engine whose chunks slow its streams: the
budget comes down from the cap, never under the floor, and every request's greedy tokens are
those of a fixed budget, the pool all free after."""

from __future__ import annotations

import pytest

from tests.engine.conftest import long_prompt_beside_two_streams
from veloxquant_mlx.config.settings import Settings
from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.engine.loop.prefill_budget import PrefillBudget
from veloxquant_mlx.engine.model.choices import prefill_stall_ratio

MS = 0.001


def _decode_only(budget: PrefillBudget, gap: float, turns: int = 20, rows: int = 2) -> None:
    for _ in range(turns):
        budget.observe(gap, 0, rows)


def test_a_slow_prefill_step_cuts_the_budget_in_proportion_and_not_under_the_floor():
    budget = PrefillBudget(512, 2048, ratio=2.5)
    assert (budget.tokens, budget.floor, budget.quantum) == (512, 128, 64)
    _decode_only(budget, 10 * MS)
    assert budget.reference(2) == pytest.approx(10 * MS)
    assert budget.reference(1) is None and budget.reference(4) is None  # by batch size
    budget.observe(50 * MS, 512, 2)  # 2x over the 25 ms limit: halved
    assert budget.tokens == 256
    budget.observe(30 * MS, 0, 2)  # the turn after a chunk judges it too: 25/30 of 256
    assert budget.tokens == 192  # rounded down to the quantum
    budget.observe(400 * MS, 192, 2)  # at most halved, never under the floor
    assert budget.tokens == 128
    budget.observe(400 * MS, 128, 2)
    assert budget.tokens == 128


def test_the_budget_grows_back_a_quantum_at_a_time_when_used_and_within_the_limit():
    budget = PrefillBudget(512, 2048, ratio=2.5)
    _decode_only(budget, 10 * MS)
    budget.observe(100 * MS, 512, 2)
    assert budget.tokens == 256
    budget.observe(15 * MS, 32, 2)  # within the limit but a small chunk: says nothing
    budget.observe(15 * MS, 0, 2)
    assert budget.tokens == 256
    _decode_only(budget, 10 * MS, 1)
    budget.observe(15 * MS, 256, 2)  # the budget used, well within 25 ms ...
    assert budget.tokens == 256
    budget.observe(12 * MS, 0, 2)  # ... and the turn after too
    assert budget.tokens == 320
    budget.observe(12 * MS, 320, 2)
    budget.observe(24 * MS, 0, 2)  # within the limit, but not well within: held
    assert budget.tokens == 320
    for _ in range(10):
        budget.observe(12 * MS, budget.tokens, 2)
    assert budget.tokens == 512  # the cap


def test_turns_without_decoding_rows_or_after_an_idle_engine_are_not_counted():
    budget = PrefillBudget(512, 2048, ratio=2.5)
    budget.observe(5.0, 512, 0)  # nobody decodes: no stream waited
    budget.observe(5.0, 512, 1)  # the first turn after: the gap is the idle engine's
    assert budget.reference(1) is None and budget.tokens == 512
    budget.observe(1.0, 512, 1)  # no reference yet: nothing to compare with
    assert budget.tokens == 512
    _decode_only(budget, 10 * MS)
    budget.observe(60 * MS, 0, 0)
    budget.observe(60 * MS, 512, 1)  # after a turn with no row decoding
    assert budget.tokens == 512
    budget.reset()
    assert (budget.tokens, budget.reference(2)) == (512, None)


def test_a_fixed_budget_never_moves():
    budget = PrefillBudget(512, 2048, ratio=0.0)
    _decode_only(budget, 10 * MS)
    budget.observe(1.0, 512, 2)
    assert budget.tokens == 512 and not budget.adaptive
    assert not PrefillBudget(16, 2048, ratio=2.5).adaptive  # the floor is the cap
    with pytest.raises(ValueError):
        PrefillBudget(512, 2048, ratio=0.5)


def test_the_ratio_per_backend_and_as_set():
    assert prefill_stall_ratio(EngineConfig()) == 0.0  # fixed by default
    assert prefill_stall_ratio(EngineConfig(prefill_stall_ratio=3.0)) == 3.0
    # never in an mx.distributed group: each rank's clock would move its own plans
    assert prefill_stall_ratio(EngineConfig(prefill_stall_ratio=3.0), grouped=True) == 0.0
    with pytest.raises(ValueError, match="prefill-stall-ratio"):
        Settings(prefill_stall_ratio=0.5)
    assert Settings(prefill_stall_ratio=0).prefill_stall_ratio == 0


def _serve(make_engine, ratio: float) -> tuple[list[list[int]], list[int]]:
    """Two short requests decoding, then a long prompt arriving (chunks of at most 64 beside
    them); every request's tokens and the budget after each turn."""
    budgets: list[int] = []
    box: dict = {}

    def hook() -> None:  # engine thread, before each turn
        budgets.append(box["engine"]._core.scheduler.prefill_budget)

    engine = make_engine(
        kv_cache_mb=32, prefill_budget=64, prefix_caching=False, prefill_stall_ratio=ratio,
        step_hook=hook,
    )  # fmt: skip
    box["engine"] = engine
    out = long_prompt_beside_two_streams(
        engine, seed=7, prompt_tokens=900, stream_tokens=60, first_tokens=6
    )  # six decode-only steps before the long one arrives
    return out, budgets  # the fixture checks the pool all free and no owner left


def test_chunks_that_slow_the_streams_bring_the_budget_down_with_the_same_tokens(make_engine):
    # On this CPU a 64-token chunk over hundreds of cached tokens is many decode steps long,
    # so with a ratio of 1 every step carrying one is over the limit.
    moved, budgets = _serve(make_engine, 1.0)
    fixed, fixed_budgets = _serve(make_engine, 0.0)
    assert moved == fixed
    assert [len(t) for t in moved] == [60, 60, 8]
    assert set(fixed_budgets) == {64}
    assert min(budgets) < 64, budgets
    assert min(budgets) >= 16  # the floor: a quarter of the cap


def test_with_many_rows_or_no_reference_the_budget_goes_back_to_the_cap():
    budget = PrefillBudget(512, 2048, ratio=2.5)
    _decode_only(budget, 2 * MS)  # 2 rows decoding: 2 ms
    budget.observe(50 * MS, 512, 2)
    assert budget.tokens == 256
    for _ in range(2):
        budget.observe(50 * MS, 128, 12)  # 12 rows, a chunk every step: no reference
    assert budget.tokens == 384
    _decode_only(budget, 10 * MS, 3, rows=12)  # decode-only steps of 12 rows: one now
    budget.observe(60 * MS, 384, 12)  # 6x: halved
    assert budget.tokens == 192
    for _ in range(300):  # the reference is forgotten after 256 turns without one
        budget.observe(150 * MS, 64, 12)
    assert budget.tokens == 512
    _decode_only(budget, 30 * MS, 3, rows=100)
    budget.observe(300 * MS, 512, 100)  # many clients: the cap, whatever the step
    assert budget.tokens == 512
