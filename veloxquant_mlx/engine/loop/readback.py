"""A launched step's tokens back on the host: each request's text, stops, logprobs and finish.

The core calls ``read_back`` once per launch, a step after it was launched (the next step runs
meanwhile), and ``push_finish`` once per request that ends. Engine thread only; the counters
are the inbox's, under its lock.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from veloxquant_mlx.engine.loop.inbox import Inbox
from veloxquant_mlx.engine.loop.rows import Sampled
from veloxquant_mlx.engine.loop.seq import Seq
from veloxquant_mlx.engine.request.handle import RequestHandle
from veloxquant_mlx.engine.request.running import Running
from veloxquant_mlx.engine.types import FinishEvent, TokenEvent, Usage


def read_back(
    sampled: Sampled,
    live: dict[int, Seq],
    eos: frozenset[int],
    n_layers: int,
    interval: float,
    inbox: Inbox,
) -> list[tuple[Seq, str]]:
    """Turn ``sampled``'s tokens into each live request's pending events and deliver them when
    one is due; returns the requests that finished, with why ("stop", "length"), for the core
    to end. A request's own text, stop strings and logprobs failing is its fault alone."""
    tokens: list[int] = sampled.tokens.tolist()  # type: ignore[assignment]
    drawn = sampled.drawn  # logprobs: one read for the batch, then plain lists
    chosen, top_ids, top_lps = (
        _listed(drawn.token_logprobs),
        _listed(drawn.top_ids),
        _listed(drawn.top_logprobs),
    )
    now = time.monotonic()
    finished: list[tuple[Seq, str]] = []
    stepped: list[Running] = []
    for i, seq in enumerate(sampled.seqs):
        if seq is None:  # a hole
            continue
        run: Running | None = seq.out
        if run is None or seq.handle.done or seq.request_id not in live:
            continue
        token = tokens[i]
        seq.tokens.append(token)
        stepped.append(run)
        if run.fault.error is not None:
            continue
        at_eos = token in eos
        try:
            text, stopped = run.add_eos() if at_eos else run.add_token(token)
            logprob, top = run.logprobs(
                chosen[i] if chosen else None,
                top_ids[i] if top_ids else [],
                top_lps[i] if top_lps else [],
            )
        except Exception as exc:
            run.fault.record("detokenizer or logprobs", exc)
            continue
        if at_eos and logprob is None:  # EOS has no text: an event only to carry logprobs
            finished.append((seq, "stop"))
            continue
        run.pending.append(TokenEvent(token, text, now, logprob, top))
        run.peak_blocks = max(run.peak_blocks, 2 * n_layers * seq.n_blocks)
        if stopped:
            finished.append((seq, "stop"))
        elif run.n_generated >= seq.handle.request.max_tokens:
            finished.append((seq, "length"))
    with inbox.lock:
        inbox.counters.generated_tokens += len(stepped)
    # Tokens go out when some request is due (its first token, `interval` since its last
    # delivery, its finish), and then everyone's pending tokens go along: each delivery wakes
    # the consumer's thread, so one wake-up carries as much as it can.
    if finished or any(r.is_due(now, interval) for r in stepped):
        RequestHandle.push_tokens([(r.handle, r.take_all(now)) for r in stepped])
    return finished


def _listed(values: mx.array | None) -> list[Any]:
    return [] if values is None else values.tolist()  # type: ignore[return-value]


def push_finish(
    inbox: Inbox,
    handle: RequestHandle,
    reason: str,
    n_generated: int,
    peak_blocks: int,
    kv_bytes_per_block: int,
    tail: str = "",
    error: str | None = None,
    code: str | None = None,
    cached_tokens: int = 0,
    stop_string: str | None = None,
) -> None:
    """Count a request's end and push its one ``FinishEvent`` (usage included)."""
    usage = Usage(
        prompt_tokens=len(handle.request.prompt_tokens),
        completion_tokens=n_generated,
        peak_kv_blocks=peak_blocks,
        peak_kv_bytes=peak_blocks * kv_bytes_per_block,
        cached_tokens=cached_tokens,
    )
    with inbox.lock:
        inbox.counters.finished[reason] += 1
        if code is not None:
            inbox.counters.failed[code] += 1
    handle._push(
        FinishEvent(reason, usage, time.monotonic(), tail, error, code, stop_string=stop_string)
    )
