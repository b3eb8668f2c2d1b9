"""How many parts a prompt's chunk is launched in while rows decode (``PrefillParts``,
``--prefill-parts``): a fixed count, or (``auto``) the fewest that keep each turn carrying a
part within ``RATIO`` times a decode-only turn. A part of the scheduler's policy; no MLX.

A chunk launched whole makes every decoding stream wait for all of its forward: on an H100 a
cached agent turn's chunk beside a few decoding rows took 49 ms where a decode step took 15
(8B), and the streams' inter-token p99 was 3.2-4.6x their median. Launched in P parts (a run of
its layers a turn, ``layer_capture``), each of their turns waits for about 1/P of it, and the
chunk's own prompt waits P - 1 more turns for its first token. So auto takes

    P = ceil(rate * (n + OVERHEAD_TOKENS) / ((RATIO - 1) * reference))

for a chunk of ``n`` tokens: ``reference`` the decode-only gap of the batch's size
(``DecodeGaps``), ``rate`` what a token of a chunk (with a forward's fixed cost, counted as
``OVERHEAD_TOKENS`` more) adds to the turns it is launched in, learned from the turns prefill
touched: their gaps over the reference, summed, over the work launched in them. Until a rate
and a reference are known a chunk goes in ``START`` parts; past ``UP_TO`` decoding rows
(many clients, where the scheduler must keep up with arrivals and plans no other prefill while
a chunk is being launched) whole.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from veloxquant_mlx.engine.loop.join_clock import OVERHEAD_TOKENS
from veloxquant_mlx.engine.loop.prefill_budget import UP_TO, DecodeGaps
from veloxquant_mlx.engine.loop.seq import Chunk

log = logging.getLogger("veloxquant.engine")

RATIO = 2.0  # a turn carrying a part: at most this many times a decode-only turn
MOST = 16  # parts at most (a chunk's first token waits a turn for each)
START = 4  # parts before anything is measured (on an H100, 4 parts: 0.90-0.98x the throughput)
WEIGHT = 0.3  # each window's weight in the learned rate
WINDOW = 8  # touched turns summed at most before their rate is taken


class PrefillParts:
    """Parts for a chunk (``parts``), learned from the turns (``observe``). Engine thread only.

    Args:
        fixed: Every chunk in this many parts; None: auto.
        gaps: The decode-only turns' gaps (the scheduler's, fed by its budget).
        ratio: Auto's limit on a turn carrying a part, in decode-only turns (> 1).
    """

    def __init__(self, fixed: int | None, gaps: DecodeGaps, ratio: float = RATIO) -> None:
        if ratio <= 1:
            raise ValueError(f"the parts' stall ratio must be over 1, got {ratio}")
        self.fixed = fixed
        self.gaps = gaps
        self.ratio = ratio
        self.rate: float | None = None  # seconds a chunk's token adds to decoding turns
        self._work = 0.0  # tokens (overhead included) launched in the window's turns
        self._extra = 0.0  # seconds their gaps were over the reference
        self._turns = 0
        self._last_work = 0.0

    @property
    def auto(self) -> bool:
        return self.fixed is None

    def parts(self, n_tokens: int, decoding: int) -> int:
        """Parts for a chunk of ``n_tokens`` launched beside ``decoding`` decoding rows."""
        if self.fixed is not None:
            return self.fixed
        if decoding > UP_TO:
            return 1
        reference = self.gaps.reference(decoding)
        if reference is None or self.rate is None:
            return START
        cost = self.rate * (n_tokens + OVERHEAD_TOKENS)
        return max(1, min(MOST, math.ceil(cost / ((self.ratio - 1) * reference))))

    def assign(self, chunks: list[Chunk], decoding: int) -> list[Chunk]:
        """``chunks``, planned beside ``decoding`` decoding rows, each with its parts (one
        debug line where they are learned)."""
        chunks = [dataclasses.replace(c, parts=self.parts(c.n, decoding)) for c in chunks]
        if self.auto and log.isEnabledFor(logging.DEBUG):
            log.debug(
                "prefill beside %d decoding rows: chunks of %s tokens in %s parts (%s)",
                decoding, [c.n for c in chunks], [c.parts for c in chunks],
                "nothing learned" if self.rate is None else f"{1e6 * self.rate:.1f} us a token",
            )  # fmt: skip
        return chunks

    def reset(self) -> None:
        """Nothing learned (after the warm-up: its steps are not traffic)."""
        self.rate, self._last_work = None, 0.0
        self._work = self._extra = 0.0
        self._turns = 0

    def observe(self, gap: float, work: float, decoding: int, counted: bool) -> None:
        """A turn ended ``gap`` seconds after the previous one, having launched ``work``
        tokens of prefill (a part of a chunk counts its share of the chunk's tokens and
        overhead) beside ``decoding`` rows; ``counted``: they decoded through the whole gap
        (``DecodeGaps.observe``). A turn that launched work, and the one after it (where the
        work's cost shows when it ran on a stream of its own), add to the window; a turn
        without either closes it."""
        after, self._last_work = self._last_work > 0, work
        if self.fixed is not None or not counted:
            return
        if not work and not after:
            self._learn()
            return
        reference = self.gaps.reference(decoding)
        if reference is None:
            return
        self._work += work
        self._extra += max(0.0, gap - reference)
        self._turns += 1
        if self._turns >= WINDOW:
            self._learn()

    def _learn(self) -> None:
        """The window's rate into the learned one."""
        if self._work > 0 and self._turns:
            sample = self._extra / self._work
            self.rate = sample if self.rate is None else self.rate + WEIGHT * (sample - self.rate)
        self._work = self._extra = 0.0
        self._turns = 0
