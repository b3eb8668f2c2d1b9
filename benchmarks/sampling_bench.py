"""The sampling of one decode step, alone: batched against mlx_lm's per-row samplers.

    python -m benchmarks.sampling_bench --rows 8,32,128 --vocab 32000

For each batch size it times (milliseconds a step, evaluated, median of ``--steps``):

- ``greedy``: one argmax over the batch (the floor);
- ``batched``: ``BatchSampler`` with every row at temperature 0.7 and top_p 0.9 (logits in
  ``--dtype``, a model's output dtype), its top_p cut by a sort (on a CPU: numpy's, on the
  host), and ``histogram``: the same with the sort-free cut (``--sampling-cut histogram``;
  16-bit logits only);
- ``batched+proc``: the same with a repetition / presence / frequency penalty and a logit_bias
  of 8 ids on every row;
- ``per-row``: mlx_lm's ``make_sampler`` (and ``make_logits_processors`` for ``+proc``) called
  row by row, as a per-request sampler is.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from veloxquant_mlx.engine.request.sampling import BatchSampler, RowSampling
from veloxquant_mlx.engine.types import SamplingParams

SAMPLED = SamplingParams(temperature=0.7, top_p=0.9)
BIAS = tuple((300 + 7 * i, 0.5) for i in range(8))
PROCESSED = SamplingParams(
    temperature=0.7,
    top_p=0.9,
    repetition_penalty=1.1,
    presence_penalty=0.3,
    frequency_penalty=0.2,
    logit_bias=BIAS,
)


def timed(step: Callable[[mx.array], list[mx.array]], logits: mx.array, steps: int) -> float:
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        mx.eval(step(logits))
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def batched(
    params: SamplingParams, rows: int, vocab: int, cut: str = "sort"
) -> Callable[[mx.array], list[mx.array]]:
    states = [RowSampling(params, vocab) for _ in range(rows)]
    for s in states:
        s.start_window(list(range(100, 140)), vocab)
    sampler = BatchSampler(states, vocab, cut=cut)
    fed = mx.arange(rows, dtype=mx.uint32)

    def step(logits: mx.array) -> list[mx.array]:
        drawn = sampler.draw(logits, fed if sampler.penalized else None)
        return [drawn.tokens, *drawn.state]

    return step


def per_row(params: SamplingParams, rows: int) -> Callable[[mx.array], list[mx.array]]:
    samplers = [make_sampler(params.temperature, params.top_p) for _ in range(rows)]
    processors = [
        make_logits_processors(
            logit_bias=dict(params.logit_bias) or None,
            repetition_penalty=None
            if params.repetition_penalty == 1.0
            else params.repetition_penalty,
            presence_penalty=params.presence_penalty or None,
            frequency_penalty=params.frequency_penalty or None,
        )
        for _ in range(rows)
    ]
    context = mx.arange(100, 140)

    def step(logits: mx.array) -> list[mx.array]:
        out = []
        for i in range(rows):
            row = logits[i : i + 1]
            for p in processors[i]:
                row = p(context, row)
            lp = row - mx.logsumexp(row, axis=-1, keepdims=True)
            out.append(samplers[i](lp))
        return [mx.concatenate(out)]

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="8,32,128")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16", help="the logits' (a model's output dtype)")
    a = p.parse_args()
    dtype = getattr(mx, a.dtype)
    print(f"device {mx.default_device()}, vocabulary {a.vocab}, {a.dtype}, ms a step (median)")
    print(
        "| rows | greedy | batched | histogram | per-row | per-row / batched | batched+proc "
        "| per-row+proc | per-row / batched (+proc) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in (int(x) for x in a.rows.split(",")):
        logits = (mx.random.normal((rows, a.vocab)) * 3).astype(dtype)
        mx.eval(logits)
        greedy = timed(lambda x: [mx.argmax(x, axis=-1)], logits, a.steps)
        ours = timed(batched(SAMPLED, rows, a.vocab), logits, a.steps)
        hist = timed(batched(SAMPLED, rows, a.vocab, "histogram"), logits, a.steps)
        stock = timed(per_row(SAMPLED, rows), logits, a.steps)
        ours_p = timed(batched(PROCESSED, rows, a.vocab), logits, a.steps)
        stock_p = timed(per_row(PROCESSED, rows), logits, a.steps)
        print(
            f"| {rows} | {greedy:.1f} | {ours:.1f} | {hist:.1f} | {stock:.1f} | "
            f"{stock / ours:.1f}x | "
            f"{ours_p:.1f} | {stock_p:.1f} | {stock_p / ours_p:.1f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
