"""The prefill budget a step spends beside decoding rows (``PrefillBudget``): fixed, or moved by
measurement so that a step carrying prefill keeps the decoding streams' gap near a multiple of
a decode-only step's (``--prefill-stall-ratio``). A part of the scheduler's policy; no MLX.

A decoding stream sees one token per engine turn, so the time between two turns' ends is its
inter-token gap. Turns without prefill (and not right after one: with prefill on a stream of
its own, a chunk's cost shows in the next turn's read-back) set the reference gap, a moving
average per batch size (rows decoding, by powers of two). A turn touched by prefill longer
than ``ratio`` times the reference cuts the budget in proportion (at most by half, never under
the floor); a chunk that used most of the budget with its turn and the next well within the
limit adds a quantum back. Additive increase, multiplicative decrease: a burst of slow steps
settles the budget at the widest chunk the device takes within the limit.

Past ``UP_TO`` decoding rows (many clients, where a step must keep up with the arrivals: on an
H100 with the 1B shape a moving budget made the TTFT p50 at 128 clients of short prompts 3.8x a
fixed one's) and where no recent decode-only turn of the batch's size is known, the budget goes
back to the cap, a quantum a turn.

Off by default (ratio 0): measured on an H100's agent sessions it evened the streams (0.71-0.84x
the inter-token p99) at a later first token (1.23-1.41x the TTFT p50; DESIGN-NOTES.md).

The reference gaps (``DecodeGaps``) are kept whether the budget moves or not: the parts a chunk
is launched in (``prefill_parts.PrefillParts``) are sized by them too.
"""

from __future__ import annotations

BASE_WEIGHT = 0.1  # the reference gap's moving average: each decode-only turn's weight
MAX_CUT = 0.5  # one slow turn cuts the budget to no less than this share
GROW_WITHIN = 0.75  # a chunk's turns this far under the limit let the budget grow ...
USED = 0.75  # ... when it used at least this share of the budget
STALE = 256  # counted turns after which a batch size's reference is forgotten
UP_TO = 16  # rows decoding up to which the budget moves (agent sessions: a few)


class DecodeGaps:
    """The gap a decoding stream sees between two tokens in turns without prefill: a moving
    average per batch size (rows decoding, by powers of two). A turn counts where rows decoded
    through the whole gap (in it and the turn before); it sets the reference where neither it
    nor the turn before launched prefill work (with prefill on a stream of its own a chunk's
    cost shows in the next turn). Engine thread only."""

    def __init__(self) -> None:
        # batch size class -> (seconds between decode-only turns' ends, the turn it was set)
        self._references: dict[int, tuple[float, int]] = {}
        self.turn = 0  # counted turns
        self._last_decoding = False
        self._last_touched = False

    def reference(self, decoding: int) -> float | None:
        """The decode-only gap known for ``decoding`` rows (None: none, or forgotten)."""
        known = self._references.get(decoding.bit_length())
        if known is None or self.turn - known[1] > STALE:
            return None
        return known[0]

    def reset(self) -> None:
        self._references, self.turn = {}, 0
        self._last_decoding = self._last_touched = False

    def observe(self, gap: float, touched: bool, decoding: int) -> bool:
        """One turn ended ``gap`` seconds after the previous one, ``touched`` if it launched
        prefill work, with ``decoding`` rows decoding. Returns whether it counted."""
        after, self._last_touched = self._last_touched, touched
        counted = decoding > 0 and self._last_decoding  # a stream waited the whole gap
        self._last_decoding = decoding > 0
        if not counted:
            return False
        self.turn += 1
        if not touched and not after:
            reference = self.reference(decoding)
            ref = gap if reference is None else reference + BASE_WEIGHT * (gap - reference)
            self._references[decoding.bit_length()] = (ref, self.turn)
        return True


class PrefillBudget:
    """Prompt tokens a step may carry while rows decode (``tokens``), and while none does
    (``idle``). Engine thread only."""

    def __init__(
        self,
        cap: int,
        idle: int,
        ratio: float = 0.0,
        floor: int | None = None,
    ) -> None:
        if ratio < 0 or 0 < ratio < 1:
            raise ValueError(f"the prefill stall ratio must be 0 or >= 1, got {ratio}")
        self.cap = cap
        self.idle = max(cap, idle)
        self.ratio = ratio  # 0: a fixed budget
        self.floor = min(cap, floor if floor is not None else max(16, cap // 4))
        # Budgets move in quanta (chunk widths the device meets again, a few of them)
        self.quantum = max(1, min(64, self.floor // 2))
        self.tokens = cap
        self.gaps = DecodeGaps()  # fed here (``observe``); the parts read it too
        self._held: tuple[int, float] | None = None  # the previous turn's (prefill, gap)

    @property
    def adaptive(self) -> bool:
        return self.ratio > 0 and self.floor < self.cap

    def reference(self, decoding: int) -> float | None:
        """The decode-only gap known for ``decoding`` rows (None: none, or forgotten)."""
        return self.gaps.reference(decoding)

    def reset(self) -> None:
        """Back to the cap with no reference (after the warm-up: its steps are not traffic)."""
        self.tokens, self._held = self.cap, None
        self.gaps.reset()

    def observe(self, gap: float, prefilled: int, decoding: int, touched: bool = False) -> bool:
        """One turn ended ``gap`` seconds after the previous one, having prefilled
        ``prefilled`` prompt tokens beside ``decoding`` decoding rows (``touched``: it
        launched a part of a chunk planned earlier). Feeds the reference gaps; then, where
        the budget moves, a chunk is judged by its own turn and the next (where its cost
        shows when it ran on a stream of its own): either over the limit cuts the budget;
        both well within it, with the budget used, grow it. Returns whether the turn counted
        (``DecodeGaps.observe``)."""
        counted = self.gaps.observe(gap, touched or prefilled > 0, decoding)
        held, self._held = self._held, None
        if not self.adaptive or not counted:
            return counted
        if not prefilled and held is None:  # no chunk of this budget's to judge
            return counted
        if prefilled:
            self._held = (prefilled, gap)
        reference = self.reference(decoding)
        if reference is None or decoding > UP_TO:  # back toward the cap
            self.tokens = min(self.cap, self.tokens + self.quantum)
        else:
            limit = self.ratio * reference
            if gap > limit:
                cut = self.tokens * max(MAX_CUT, limit / gap)
                self.tokens = max(self.floor, int(cut) // self.quantum * self.quantum)
            elif held is not None and self._grows(held, gap, limit):
                self.tokens = min(self.cap, self.tokens + self.quantum)
        return counted

    def _grows(self, held: tuple[int, float], gap: float, limit: float) -> bool:
        """The previous turn's chunk used most of the budget, and both its turns were well
        within the limit."""
        return held[0] >= USED * self.tokens and max(held[1], gap) < GROW_WITHIN * limit
