"""Where a slow step's time went: ``TurnClock`` marks the phases of one engine turn and, past
``SLOW_TURN_S``, logs them at debug level (``--log-level debug``) with what the turn carried.

For finding what stalls the streams (a long gap between two tokens is a slow turn): the
schedule, the prefills (built, and run where a chunk's KV must be ready for the next), the
decode step's build and launch, and the read-back of the previous step's tokens, which waits
for that step to finish on the device. Costs a few clock reads a turn; nothing is logged
unless debug logging is on. Engine thread only.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from veloxquant_mlx.engine.loop.seq import StepPlan

log = logging.getLogger("veloxquant.engine")

SLOW_TURN_S = 0.05  # a turn at least this long is logged (debug level)
PHASES = ("schedule", "prefill", "build", "launch", "read back")


class TurnClock:
    def __init__(self) -> None:
        self._marks: list[float] = []
        self._last_end = time.perf_counter()

    def start(self) -> None:
        self._marks = [time.perf_counter()]

    def mark(self) -> None:
        """The end of the next phase (``PHASES``, in order)."""
        self._marks.append(time.perf_counter())

    def gap(self) -> float:
        """Seconds from the previous turn's end to this one's: the gap a decoding stream saw
        between two tokens."""
        end = self._marks[-1]
        gap, self._last_end = end - self._last_end, end
        return gap

    def report(self, rows: int, plan: StepPlan) -> None:
        """Log the turn if it was slow: total and per-phase milliseconds, the decoding rows,
        and the prompt tokens ``plan`` prefilled (its chunks, and its prompts prefilled
        together in one forward). Nothing is counted unless the line is logged."""
        marks = self._marks
        if len(marks) < 2 or marks[-1] - marks[0] < SLOW_TURN_S:
            return
        if not log.isEnabledFor(logging.DEBUG):
            return
        phases = ", ".join(
            f"{name} {1000 * (b - a):.0f}"
            for name, a, b in zip(PHASES, marks, marks[1:], strict=False)
        )
        tokens = plan.prompt_tokens
        log.debug(
            "slow step: %.0f ms (%s); %d rows decoding, %d prompt tokens prefilled "
            "(%d chunks, %d prompts together)",
            1000 * (marks[-1] - marks[0]), phases, rows, tokens, len(plan.chunks),
            len(plan.together),
        )  # fmt: skip
