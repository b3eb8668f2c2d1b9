"""Log lines for long prefills (``PrefillProgress``): an agent's cold prompt of tens of
thousands of tokens can prefill for minutes on a laptop, and its operator should see it move,
see it end, and see what a prompt that left partway (its client's timeout) kept for its retry.
A prefill is followed once it has run ``EVERY_S`` seconds, so short ones log nothing. Engine
thread only; no MLX.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from veloxquant_mlx.engine.loop.seq import Chunk, Seq

log = logging.getLogger("veloxquant.engine")

EVERY_S = 10.0  # seconds between a long prefill's progress lines


@dataclass(slots=True)
class _Followed:
    started: float  # its first chunk's launch
    start_token: int  # where its first chunk started (what was cached before it)
    last_line: float  # its last progress line (``started`` before the first)
    lines: int = 0


class PrefillProgress:
    """Follows every prompt being prefilled in chunks; logs those that run long."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._prompts: dict[int, _Followed] = {}

    def chunks(self, chunks: list[Chunk]) -> None:
        """The turn launched ``chunks``: a line for each prompt ``EVERY_S`` seconds after its
        last, and one when a prompt that had a line finishes."""
        if not chunks:  # most turns: nothing to read the clock for
            return
        now = self._clock()
        for chunk in chunks:
            seq = chunk.seq
            followed = self._prompts.get(seq.request_id)
            if followed is None:
                if chunk.completes:
                    continue  # one chunk: nothing to follow
                followed = self._prompts[seq.request_id] = _Followed(now, chunk.start, now)
            done = chunk.start + chunk.n - followed.start_token
            todo = len(seq.tokens) - followed.start_token
            if chunk.completes:
                del self._prompts[seq.request_id]
                if followed.lines:
                    seconds = now - followed.started
                    log.info(
                        "request %d: prompt prefilled, %d tokens in %.0f s (%.0f tokens/s; "
                        "%d were cached)",
                        seq.request_id,
                        todo,
                        seconds,
                        todo / max(seconds, 1e-9),
                        followed.start_token,
                    )
            elif now - followed.last_line >= EVERY_S:
                followed.last_line, followed.lines = now, followed.lines + 1
                log.info(
                    "request %d: prefilling, %d of %d prompt tokens (%.0f%%) in %.0f s",
                    seq.request_id,
                    done,
                    todo,
                    100 * done / max(todo, 1),
                    now - followed.started,
                )

    def forget(self, seq: Seq) -> None:
        """``seq`` was preempted: its prefill, when it returns, is followed anew."""
        self._prompts.pop(seq.request_id, None)

    def left(self, seq: Seq, reason: str, kept_tokens: int) -> None:
        """``seq`` ended (``reason``) during its prefill, ``kept_tokens`` of its prompt's KV
        now cached for a retry; a line if its prefill had run long enough to have one."""
        followed = self._prompts.pop(seq.request_id, None)
        if followed is not None and followed.lines:
            log.info(
                "request %d ended during its prefill (%s) after %.0f s: %d of its %d prompt "
                "tokens are in the prefix cache for a retry",
                seq.request_id,
                reason,
                self._clock() - followed.started,
                kept_tokens,
                len(seq.tokens),
            )
