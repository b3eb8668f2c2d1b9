"""The engine's record of one running request: detokenizer, stop matcher, counters."""

from __future__ import annotations

from veloxquant_mlx.engine.request.detokenize import Detokenizer
from veloxquant_mlx.engine.request.faults import RequestFault
from veloxquant_mlx.engine.request.handle import RequestHandle
from veloxquant_mlx.engine.request.stops import StopMatcher
from veloxquant_mlx.engine.types import TokenEvent


class Running:
    """One admitted request on the engine thread. Owns its detokenizer, stop matcher, fault cell
    and the token events not yet delivered to its handle (``pending``, oldest first)."""

    __slots__ = (
        "delivered_at",
        "detokenizer",
        "fault",
        "handle",
        "n_generated",
        "peak_blocks",
        "pending",
        "shown",
        "stops",
    )

    def __init__(
        self, handle: RequestHandle, detokenizer: Detokenizer, fault: RequestFault
    ) -> None:
        self.handle = handle
        self.fault = fault
        self.detokenizer = detokenizer
        self.stops = StopMatcher(handle.request.stop)
        self.n_generated = 0
        self.peak_blocks = 0
        self.pending: list[TokenEvent] = []
        self.delivered_at: float | None = None  # None: nothing delivered yet
        self.shown = False  # some delivered event had text

    def is_due(self, now: float, interval: float) -> bool:
        """Whether pending events must go out now: the first delivery, the first text (a
        first token that is only part of a character, or held back for a stop string, shows
        nothing, and the client's time to first token is its first text), or ``interval``
        since the last one."""
        if not self.pending:
            return False
        if self.delivered_at is None or now - self.delivered_at >= interval:
            return True
        return not self.shown and any(e.text for e in self.pending)

    def take_all(self, now: float) -> list[TokenEvent]:
        """Every pending event, oldest first; none is pending afterwards."""
        events, self.pending = self.pending, []
        if events:
            self.delivered_at = now
            self.shown = self.shown or any(e.text for e in events)
        return events

    def add_token(self, token: int) -> tuple[str, bool]:
        """The text this token releases, and whether a stop string was reached."""
        self.n_generated += 1
        return self.stops.feed(self.detokenizer.add_token(token))

    def add_eos(self) -> tuple[str, bool]:
        """EOS counts as a generated token (usage and logprobs both include it) but has no
        text."""
        self.n_generated += 1
        return "", True

    def flush(self) -> str:
        """Text still held (an unfinished character, a stop-string prefix) at the end."""
        text, stopped = self.stops.feed(self.detokenizer.finalize())
        return text if stopped else text + self.stops.flush()

    def logprobs(
        self, chosen: float | None, top_ids: list[int], top_logprobs: list[float]
    ) -> tuple[float | None, tuple[tuple[int, float], ...]]:
        """This request's share of a step's logprobs (the drawn token's, and the batch's top
        ones, most likely first), or (None, ()) when it did not ask for them."""
        request = self.handle.request
        if not request.logprobs or chosen is None:
            return None, ()
        k = request.top_logprobs
        return chosen, tuple(zip(top_ids[:k], top_logprobs[:k], strict=True))
