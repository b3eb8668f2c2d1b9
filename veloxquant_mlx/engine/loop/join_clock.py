"""When a prefill launched on its own stream is done on the device: a guess, since MLX cannot be
asked without waiting. With prefill on a stream of its own (``--prefill-stream``) a prompt's
last chunk runs beside the decode steps; a row that joined the batch in the step built with
that chunk would make the step wait for it (its KV goes into the step's working set), and every
decoding stream with it. So the row joins the first step built once its prefill is probably
done (``--prefill-join ready``): the decode steps keep going meanwhile.

The guess is the device's rate of prompt tokens on that stream, learned from the first tokens'
reads: a read that waited means the guess was early (the rate goes up towards the one the wait
shows); one that did not, that it may have been late (the rate goes down a little, so a guess
that is too long does not stay: each late guess costs the joining request's TTFT up to a step).
Forwards on the stream run one after another, so a launch starts when the previous one is
expected done. No MLX.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# A first token's read that waited less than this found its prefill done.
WAITED_S = 0.001
# Seconds a prompt token takes on the prefill stream before anything is measured: a 512-token
# chunk ~50 ms (a 1B model on an H200 took 35-50 ms, an 8B one 42-102 ms for 150-425 tokens).
START_RATE = 1e-4
RATE_BOUNDS = (1e-7, 1e-2)
EASE = 0.95  # a read that did not wait: the rate times this


@dataclass(frozen=True, slots=True)
class Launch:
    """One forward on the prefill stream: when it should start and be done (``clock`` time)."""

    start: float
    done: float
    n_tokens: int


class JoinClock:
    """The prefill stream's expected schedule. Engine thread only."""

    def __init__(
        self, rate: float = START_RATE, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate  # seconds per prompt token
        self.clock = clock
        self._free_at = 0.0  # when the stream is expected to have run everything launched

    def launched(self, n_tokens: int) -> Launch:
        """A forward of ``n_tokens`` (padding included) was launched on the stream now."""
        start = max(self.clock(), self._free_at)
        self._free_at = start + self.rate * n_tokens
        return Launch(start, self._free_at, n_tokens)

    def due(self, launch: Launch) -> bool:
        """Whether ``launch`` is expected done by now."""
        return self.clock() >= launch.done

    def learn(self, launch: Launch, waited: float, at: float) -> None:
        """The first token of ``launch`` was read at ``at`` after waiting ``waited`` seconds."""
        if waited > WAITED_S:  # still running: it took about until ``at``
            seen = max(at - launch.start, 0.0) / max(launch.n_tokens, 1)
            rate = 0.5 * self.rate + 0.5 * max(seen, self.rate)
            self._free_at = max(self._free_at, at)
        else:
            rate = self.rate * EASE
        self.rate = min(max(rate, RATE_BOUNDS[0]), RATE_BOUNDS[1])
