"""Warm start: the shapes the engine will meet, run once before it says it is ready.

MLX compiles a kernel the first time it meets a shape (on a GPU: seconds for the first steps of
a fresh install; later processes find them in its cache), so without this the first users of a
new server pay those compiles on the request path. The engine runs, before ``ready``, waves of
synthetic requests: every batch size from 1 up to ``max_running`` in powers of two, a prompt of
one prefill chunk (of either width: ``--prefill-step`` and the budget beside decoding; with
prefill widths padded to a bucket, every bucketed width up to them) and one of several
chunks; rows at different positions (the masked decode step) beside a prompt prefilled in
chunks, at 2 rows and at ``max_running``; sampled requests of each combination of cuts
(temperature alone, with top_p, with min_p; top-k/top-p with penalties and logprobs); with
several KV formats (``--kv-formats``), every batch size in each other
format and rows of every format at once (each format's store meets its own shapes); on CUDA
a long conversation (``--warm-up-context``: a prompt of thousands of tokens beside a decoding
row, then resent with a few more tokens, an agent's next turn); then it drops what they left
(cached pages, counters). With ``--prefill-attention buckets`` it also builds cuDNN's graph
for every bucketed prefill shape (``prefill_attention_shapes``). Engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from veloxquant_mlx.engine.loop.prefix_cache import CacheCounts
from veloxquant_mlx.engine.types import GenerationRequest, SamplingParams
from veloxquant_mlx.kv import chunk_attention

if TYPE_CHECKING:
    from veloxquant_mlx.engine.loop.core import EngineCore

# Request ids of the warm-up, above any a host hands out (they are the pool's owners).
WARM_UP_ID = 1 << 62
PRELOAD_ID = WARM_UP_ID + (1 << 40)  # the prefix cache's preload (``preload.read_back``)
PROMPT = 8  # tokens of a decode wave's prompts
DECODE = 3  # tokens each request generates
RAGGED_DECODE = 12  # tokens the ragged waves' rows generate (decoding while a prompt goes in)
NEXT_TURN = 64  # tokens the long conversation's second turn adds
WARM_KEYS = 32_768  # bucketed prefill attention's shapes are built up to this many keys
WARM_BUCKET_SECONDS = 60.0  # and for at most this long (the rest are built when first met)


def wanted(mode: str) -> bool:
    """Whether to warm up: "on", "off", or "auto": on a GPU. On this CPU a fresh engine's first
    burst of 16 requests took ~0.38 s against ~0.31 s later (little to compile), while the
    warm-up itself costs 2-3 s of start; on an H200 the first server on a fresh machine had
    seconds of p99 TTFT that later ones did not (BENCHMARKS.md)."""
    if mode == "auto":
        return mx.default_device() == mx.gpu
    return mode == "on"


def long_context(setting: int, context_window: int | None, fits: Callable[[int], bool]) -> int:
    """Tokens of the warm-up's long conversation (``--warm-up-context``, off by default: on an
    H200 it cost an 8B server ~55 s of start and did not make a restarted first turn faster;
    DESIGN-NOTES.md): ``setting``, at most the context window less its second turn and what
    ``fits(n)`` (a request of n tokens fits the pool alone) allows, halving; 0 below a few
    chunks' worth."""
    n = setting
    if context_window:
        n = min(n, context_window - NEXT_TURN - DECODE - 1)
    while n >= 1024 and not fits(n + NEXT_TURN + DECODE):
        n //= 2
    return n if n >= 1024 else 0


def warm_up_waves(
    max_running: int,
    prefill_step: int,
    context_window: int | None,
    vocab_size: int,
    prefill_budget: int | None = None,
    bucket: int = 0,
    formats: tuple[str, ...] = (),
    conversation: int = 0,
) -> list[list[GenerationRequest]]:
    """The warm-up's waves, run one after the other (each to its end, so each batch size is
    met). Prompts differ from each other, so no prefix-cache hit changes a shape. The chunk
    widths met are ``prefill_step`` and, while others decode, ``prefill_budget``; with
    ``bucket`` (prefill widths padded to its multiples), each multiple up to the larger.
    ``formats``: the KV formats besides the server's own a request may ask for.
    ``conversation``: tokens of a long conversation (``long_context``), whose second turn
    resends the first turn's prompt (a prefix-cache hit, where caching is on) with
    ``NEXT_TURN`` more tokens."""
    waves: list[list[GenerationRequest]] = []
    serial = 0

    def prompt(n: int) -> tuple[int, ...]:
        nonlocal serial
        serial += 1
        return tuple((serial * 7919 + i * 31) % (vocab_size - 1) + 1 for i in range(n))

    sizes, size = [], 1
    while size < max_running:
        sizes.append(size)
        size *= 2
    sizes.append(max_running)
    greedy = SamplingParams(temperature=0.0)
    for size in sizes:
        waves.append([GenerationRequest(prompt(PROMPT), DECODE, greedy) for _ in range(size)])
    window = context_window or 1 << 30
    chunk = min(prefill_budget or prefill_step, prefill_step)
    widths = {chunk, prefill_step, 2 * prefill_step + PROMPT}
    if bucket:
        widths |= set(range(bucket, max(chunk, prefill_step) + 1, bucket))
    for n in sorted(widths):
        if n + DECODE <= window:
            waves.append([GenerationRequest(prompt(n), DECODE, greedy)])
    # Rows that joined at different times decode at different positions: a masked step, which
    # the waves above (rows of one wave, one length) never meet; and while they decode, a
    # prompt of several chunks goes in beside them. A fresh H200 server paid 3-4 s of compiles
    # on such steps in its first agent turns (the slow-step log, BENCHMARKS.md).
    long = chunk + PROMPT
    for rows in sorted({min(2, max_running), max_running}):
        if long + RAGGED_DECODE <= window:
            waves.append(
                [
                    GenerationRequest(prompt(PROMPT + i % 16), RAGGED_DECODE, greedy)
                    for i in range(rows)
                ]
                + [GenerationRequest(prompt(long), DECODE, greedy)]
            )
    if conversation:
        first = prompt(conversation)
        waves.append(
            [
                GenerationRequest(prompt(PROMPT), RAGGED_DECODE, greedy),
                GenerationRequest(first, DECODE, greedy),
            ]
        )
        waves.append([GenerationRequest(first + prompt(NEXT_TURN), DECODE, greedy)])
    # Each combination of cuts is a function of its own to compile on a GPU (the draw,
    # ``request.sampling``): temperature alone and with top_p (what chat clients send), with
    # min_p, and top_k with penalties and logprobs.
    for sampled, logprobs in (
        (SamplingParams(temperature=0.7), False),
        (SamplingParams(temperature=0.7, top_p=0.9), False),
        (SamplingParams(temperature=0.7, min_p=0.05), False),
        (
            SamplingParams(
                temperature=0.8, top_p=0.9, top_k=20, repetition_penalty=1.1, presence_penalty=0.1
            ),
            True,
        ),
    ):
        waves.append(
            [
                GenerationRequest(
                    prompt(PROMPT), DECODE, sampled, logprobs=logprobs, top_logprobs=5 * logprobs
                )
                for _ in range(2)
            ]
        )
    for fmt in formats:
        for size in sizes:
            waves.append([GenerationRequest(prompt(PROMPT), DECODE, greedy, kv_format=fmt)] * size)
    if formats:  # every format at once, rows at different positions
        every = ("", *formats)
        waves.append(
            [
                GenerationRequest(
                    prompt(PROMPT + i % 16), RAGGED_DECODE, greedy, kv_format=every[i % len(every)]
                )
                for i in range(max(max_running, len(every)))
            ]
        )
    return waves


def prefill_attention_shapes(
    core: EngineCore, dtype: str, context_window: int | None, widest: int
) -> tuple[int, int]:
    """With ``--prefill-attention buckets``, build cuDNN's graphs for the bucketed chunk
    shapes up to ``widest`` tokens over up to ``WARM_KEYS`` keys (or the context window),
    shortest first, for at most ``WARM_BUCKET_SECONDS``: ``kv.chunk_attention.warm_buckets``.
    Returns how many shapes ran and how many there are ((0, 0) for another route, or a model
    whose arguments do not name its heads)."""
    if core.runner.kv.ragged.prefill_route != "buckets":
        return 0, 0
    args: Any = getattr(core.runner.prefills.model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    kind = getattr(mx, dtype, None) if dtype else None
    if not isinstance(heads, int) or not isinstance(kind, mx.Dtype):
        return 0, 0
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    shapes = chunk_attention.bucket_shapes(widest, min(context_window or WARM_KEYS, WARM_KEYS))
    ran = chunk_attention.warm_buckets(heads, kv_heads, head_dim, kind, shapes, WARM_BUCKET_SECONDS)
    return ran, len(shapes)


def run_warm_up(core: EngineCore, waves: list[list[GenerationRequest]]) -> tuple[int, int]:
    """Run ``waves`` (``warm_up_waves``) on ``core``, each to its end, then drop what they
    left: cached pages, counters, the published snapshot. Before the engine is ready. Returns
    how many requests ran and the prompt tokens they found cached (the long conversation's
    second turn)."""
    sched, cache = core.scheduler, core.scheduler.cache
    hooks = (sched.tables.disk, None if cache is None else cache.on_evict)
    sched.tables.disk = None  # the synthetic prompts neither read nor write the disk tier
    if cache is not None:
        cache.on_evict = None
    n = 0
    for wave in waves:
        core.run_before_ready(wave, WARM_UP_ID + n)
        n += len(wave)
    hits = 0 if cache is None else cache.counts.hits
    sched.tables.reset_cache()
    sched.tables.disk = hooks[0]
    if cache is not None:
        cache.on_evict = hooks[1]
        cache.counts = CacheCounts()
    core.reset_after_start()
    return n, hits
