"""Per-request fault isolation: one request's own failure (its sampling settings, grammar,
detokenizer, logprobs) ends that request, never the batch's step."""

from __future__ import annotations

import logging

log = logging.getLogger("veloxquant.engine")


class RequestFault:
    """The first failure of one request's own code (sampling setup, grammar, text).

    Every row is sampled in one batched pass, so an exception from one request's part would
    abort the step for every row. The engine catches it where it runs per row (setup, the
    grammar's advance, the detokenizer), records it here, and leaves the row unconstrained for
    the rest of the step so the step completes for everyone; the engine then ends this request
    with an error. Owned by the request's ``Running`` record; engine thread only.

    What cannot be isolated: an error MLX raises only when the step's graph is evaluated (it is
    no longer attributable to a row); that is an engine failure.
    """

    __slots__ = ("error", "request_id", "sink")

    def __init__(self, request_id: int, sink: list[RequestFault]) -> None:
        self.request_id = request_id
        self.sink = sink  # the engine's list of faults to act on after the step
        self.error: str | None = None  # for the client: no message text, no paths

    def record(self, where: str, exc: BaseException) -> None:
        """Remember the first failure (later ones are consequences)."""
        if self.error is None:
            # One line: a grammar's error can carry the parser's state over many lines.
            text = (str(exc).strip().splitlines() or [""])[0][:300]
            log.warning(
                "request %d failed in its %s: %s: %s",
                self.request_id,
                where,
                type(exc).__name__,
                text,
            )
            self.error = f"generation failed in this request's {where} ({type(exc).__name__})"
            self.sink.append(self)
