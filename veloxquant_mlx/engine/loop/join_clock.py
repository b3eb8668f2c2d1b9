"""When a prefill launched on its own stream is done on the device: a guess, since MLX cannot be
asked without waiting. With prefill on a stream of its own (``--prefill-stream``) a prompt's
last chunk runs beside the decode steps; a row that joined the batch in the step built with
that chunk would make the step wait for it (its KV goes into the step's working set), and every
decoding stream with it. So the row joins the first step built once its prefill is probably
done (``--prefill-join ready``): the decode steps keep going meanwhile.

The guess is a forward's tokens plus ``OVERHEAD_TOKENS`` (what a forward costs whatever its
width: launches, the weights' read) at the device's rate on that stream, learned from the
first tokens' reads: a read that waited means the guess was early (the rate grows by what
the wait shows, at most ``GROW_MAX`` times a read); one that did not, that it may have been
late (the rate eases by ``EASE``, so a guess that is too long does not stay: each late guess
costs the joining request's TTFT up to a step, and a multi-chunk prompt's guess adds up its
chunks'). Forwards on the stream run one after another, so a launch
starts when the previous one is expected done. No MLX.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# A forward costs about as much as this many more tokens: on an H200 the 1B shape's forward of
# 100 new tokens over 3,000-7,000 cached took 14 ms, of 500 35 ms (BENCHMARKS.md).
OVERHEAD_TOKENS = 128
# A first token's read that waited less than this found its prefill done.
WAITED_S = 0.001
# Seconds a token takes on the prefill stream before anything is measured: the 1B shape's on
# an H200 fit 55-60 us, the 8B shape's (42-102 ms for 150-425 new tokens) 150-185 us.
START_RATE = 1e-4
RATE_BOUNDS = (1e-7, 1e-2)
GROW_MAX = 2.0  # a read that waited: the rate times at most this
EASE = 0.9  # a read that did not wait: the rate times this


@dataclass(frozen=True, slots=True)
class Launch:
    """One forward on the prefill stream: when it should start and be done (``clock`` time)."""

    start: float
    done: float
    n_tokens: int  # the forward's, and ``OVERHEAD_TOKENS``


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
        n = n_tokens + OVERHEAD_TOKENS
        self._free_at = start + self.rate * n
        return Launch(start, self._free_at, n)

    def due(self, launch: Launch) -> bool:
        """Whether ``launch`` is expected done by now."""
        return self.clock() >= launch.done

    def learn(self, launch: Launch, waited: float, at: float) -> None:
        """The first token of ``launch`` was read at ``at`` after waiting ``waited`` seconds."""
        if waited > WAITED_S:  # still running: it took about until ``at``
            planned = max(launch.done - launch.start, 1e-9)
            took = max(at - launch.start, planned)
            rate = self.rate * min(took / planned, GROW_MAX)
            self._free_at = max(self._free_at, at)
        else:
            rate = self.rate * EASE
        self.rate = min(max(rate, RATE_BOUNDS[0]), RATE_BOUNDS[1])
