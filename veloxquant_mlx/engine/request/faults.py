"""Per-request fault isolation for the callables BatchGenerator runs inside a shared step."""

from __future__ import annotations

import logging
from collections.abc import Callable

import mlx.core as mx

log = logging.getLogger("veloxquant.engine")

Sampler = Callable[[mx.array], mx.array]
Processor = Callable[[mx.array, mx.array], mx.array]


class RequestFault:
    """The first failure of one request's own code (sampler, logits processors, text).

    BatchGenerator calls every row's sampler and processors inside one batched step, so an
    exception in one of them would abort the step for every row. The wrappers made here catch
    it, remember it, and stand in with a harmless value of the right shape (the argmax token,
    the logits unchanged) so the step completes for everyone; the engine then ends this request
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

    def sampler(self, fn: Sampler) -> Sampler:
        def guarded(logprobs: mx.array) -> mx.array:
            if self.error is None:
                try:
                    return fn(logprobs)
                except Exception as exc:
                    self.record("sampler", exc)
            return mx.argmax(logprobs, axis=-1)

        return guarded

    def processor(self, fn: Processor) -> Processor:
        def guarded(tokens: mx.array, logits: mx.array) -> mx.array:
            if self.error is None:
                try:
                    return fn(tokens, logits)
                except Exception as exc:
                    self.record("logits processor", exc)
            return logits

        return guarded
