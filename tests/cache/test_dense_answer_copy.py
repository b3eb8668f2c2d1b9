"""A leaving row's answer is copied out of the dense working set without making the next
step copy the working set.

MLX writes an array in place only when nothing else holds it. A copy of a leaving row's pages
(``row_span``, cached for the conversation's next turn) that is still pending when the next
step writes the working set makes that write copy the whole layer; the engine starts the copy
at once and launches the next step once it has run (``PageCopies.copied_out``). These tests watch
MLX's peak memory, which a copy of the working set raises by a layer's size.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from veloxquant_mlx.kv.dense import DenseKV

LAYERS, HEADS, DIM, ROWS, N = 2, 2, 64, 4, 1000


def joined() -> DenseKV:
    kv = DenseKV(LAYERS)
    for row in range(ROWS):
        keys = [mx.random.key(10 * row + i) for i in (0, 1)]
        layers = [tuple(mx.random.normal((1, HEADS, N, DIM), key=k) for k in keys)] * LAYERS
        kv.put_row(row, layers, None)  # type: ignore[arg-type]
    mx.eval(kv.k, kv.v)
    return kv


def step(kv: DenseKV, position: int, extra: list[mx.array]) -> None:
    batch = kv.step_batch([position] * ROWS)
    kv.begin_step(batch, 0)
    outs = list(extra)
    for layer in range(LAYERS):
        new = mx.ones((ROWS, HEADS, 1, DIM))
        outs += [a.sum() for a in kv.write_read(layer, new, new, batch)]
    mx.eval(outs)


def layer_copies(kv: DenseKV, action: Callable[[], None]) -> float:
    """Peak memory above the live set while ``action`` runs, in one layer's K and V."""
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    action()
    mx.synchronize()
    return (mx.get_peak_memory() - base) / (kv.k[0].nbytes + kv.v[0].nbytes)


def answer_copy(kv: DenseKV) -> list[mx.array]:
    """Row 1's pages past its prompt, copied (``Runner._span_source`` over ``row_span``)."""
    return [mx.contiguous(a) for pair in kv.row_span(1, 512, 992) for a in pair]


def test_a_copy_evaluated_with_the_next_step_makes_its_writes_copy_the_working_set() -> None:
    kv = joined()
    step(kv, N, [])
    assert layer_copies(kv, lambda: step(kv, N + 1, [])) < 0.25  # in place

    def deferred() -> None:
        step(kv, N + 2, answer_copy(kv))

    assert layer_copies(kv, deferred) > 0.9


def test_a_copy_started_at_once_and_waited_for_keeps_the_next_step_in_place() -> None:
    kv = joined()
    step(kv, N, [])
    copied: list[mx.array] = []

    def at_once() -> None:
        copied.extend(answer_copy(kv))
        mx.async_eval(copied)
        mx.synchronize()  # the engine's launch after a copy out (PageCopies.copied_out)
        step(kv, N + 1, [])

    assert layer_copies(kv, at_once) < 0.5
    want = [mx.contiguous(a) for pair in kv.row_span(1, 512, 992) for a in pair]
    assert all(mx.array_equal(a, b).item() for a, b in zip(copied, want, strict=True))
