"""A slow engine turn is logged at debug level with its phases; a quick one is not."""

from __future__ import annotations

import logging

from veloxquant_mlx.engine.loop import clock as clock_module
from veloxquant_mlx.engine.loop.clock import TurnClock
from veloxquant_mlx.engine.loop.seq import Chunk, StepPlan


class Prompt:  # what the clock reads of a Seq: its tokens
    def __init__(self, n: int) -> None:
        self.tokens = [1] * n


def run_turn(c: TurnClock, slow_phase: int | None, monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr(clock_module.time, "perf_counter", lambda: now[0])
    c.start()
    for i in range(len(clock_module.PHASES)):
        now[0] += 0.2 if i == slow_phase else 0.001
        c.mark()
    plan = StepPlan(chunks=[Chunk(Prompt(900), 0, 500)], together=[Prompt(12)])  # type: ignore[arg-type]
    c.report(rows=3, plan=plan)


def test_a_slow_turn_is_logged_with_its_phases_and_what_it_carried(caplog, monkeypatch):
    with caplog.at_level(logging.DEBUG, logger="veloxquant.engine"):
        run_turn(TurnClock(), slow_phase=1, monkeypatch=monkeypatch)
    (record,) = [r for r in caplog.records if "slow step" in r.getMessage()]
    text = record.getMessage()
    assert text.startswith("slow step: 204 ms (schedule 1, prefill 200, build 1, launch 1, ")
    assert "3 rows decoding, 512 prompt tokens prefilled (1 chunks, 1 prompts together)" in text


def test_a_quick_turn_or_debug_off_logs_nothing(caplog, monkeypatch):
    with caplog.at_level(logging.DEBUG, logger="veloxquant.engine"):
        run_turn(TurnClock(), slow_phase=None, monkeypatch=monkeypatch)
    with caplog.at_level(logging.INFO, logger="veloxquant.engine"):
        run_turn(TurnClock(), slow_phase=2, monkeypatch=monkeypatch)
    assert not [r for r in caplog.records if "slow step" in r.getMessage()]


def test_the_slow_steps_report_reads_the_lines_the_clock_writes(caplog, monkeypatch):
    from benchmarks import slow_steps

    with caplog.at_level(logging.DEBUG, logger="veloxquant.engine"):
        run_turn(TurnClock(), slow_phase=3, monkeypatch=monkeypatch)
    (step,) = slow_steps.parse([r.getMessage() for r in caplog.records])
    assert (step.total, step.rows, step.tokens) == (204, 3, 512)
    assert step.phases == {"schedule": 1, "prefill": 1, "build": 1, "launch": 200, "read back": 1}
    rows = slow_steps.table([step])
    assert rows[2].startswith("| with prefill, rows decoding | 1 | 204 / 204 / 204 / 204 |")
