"""The paged store is written in place: no step, join or cached-page read holds it at a write.

MLX writes into an array in place only when nothing else references it: an unevaluated read
of the store at the next write, or a launched one that has not run yet, makes that write copy
the whole pool. The engine launches a paged step once the previous one is done
(``PagedKV.launch_after_previous``); these tests do the same, and show what launching ahead
does. They watch MLX's peak memory, which a copy of the store raises by the store's size.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import mlx.core as mx
import pytest

from veloxquant_mlx.kv.paged import PagedKV

LAYERS, HEADS, DIM, BS = 2, 2, 16, 16
N_IDS = 4096  # an 8 MiB store: a copy of it stands out against everything else here


def prefilled(n: int, seed: int) -> list[tuple[mx.array, mx.array]]:
    def rand(i: int) -> mx.array:
        return mx.random.normal((1, HEADS, n, DIM), key=mx.random.key(100 * seed + i))

    return [(rand(2 * layer), rand(2 * layer + 1)) for layer in range(LAYERS)]


def table(first: int, blocks: int) -> list[list[int]]:
    return [[first + s * blocks + b for b in range(blocks)] for s in range(2 * LAYERS)]


def step(kv: PagedKV, positions: list[int]) -> None:
    batch = kv.step_batch(positions)
    kv.begin_step(batch, N_IDS - 1)
    rows = len(positions)
    outs = []
    for layer in range(LAYERS):
        new = mx.ones((rows, HEADS, 1, DIM))
        outs += list(kv.write_read(layer, new, new, batch))
    mx.async_eval(outs)
    mx.synchronize()  # done before the next step's write, as the engine waits for it


def store_copies(kv: PagedKV, action: Callable[[], None]) -> float:
    """Peak memory above the live set while ``action`` runs, in stores."""
    mx.synchronize()
    assert kv.store is not None
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    action()
    mx.synchronize()
    return (mx.get_peak_memory() - base) / kv.store.nbytes


def test_steps_joins_and_cached_page_reads_write_the_store_in_place() -> None:
    kv = PagedKV(LAYERS, BS, N_IDS)
    kv.put_row(0, prefilled(40, 0), table(0, 3))
    mx.eval(kv.store)
    step(kv, [40])
    assert store_copies(kv, lambda: step(kv, [41])) < 0.5

    # a prefix hit: the new row's first two pages are row 0's, read back for its prefill
    pages = [SimpleNamespace(ids=[t[j] for t in table(0, 3)]) for j in range(2)]

    def hit_then_join_then_step() -> None:
        cached = kv.read_pages(pages)
        rest = prefilled(40, 1)
        layers = [
            (mx.concatenate([ck, k[:, :, 32:]], axis=2), mx.concatenate([cv, v[:, :, 32:]], axis=2))
            for (ck, cv), (k, v) in zip(cached, rest, strict=True)
        ]
        kv.put_row(1, layers, table(100, 3), start=32)
        step(kv, [42, 40])
        step(kv, [43, 41])

    assert store_copies(kv, hit_then_join_then_step) < 0.5


def test_cached_pages_kept_unevaluated_across_steps_do_not_make_them_copy_the_store() -> None:
    """A caller may keep the cached pages' KV unevaluated across steps; ``read_pages`` reads
    them itself, so the steps' writes stay in place (without that this copied the store: peak
    memory one store above the live set)."""
    kv = PagedKV(LAYERS, BS, N_IDS)
    kv.put_row(0, prefilled(40, 0), table(0, 3))
    mx.eval(kv.store)
    step(kv, [40])
    pages = [SimpleNamespace(ids=[t[j] for t in table(0, 3)]) for j in range(2)]
    held: list[mx.array] = []

    def hit_evaluated_two_steps_later() -> None:
        held.extend(a for pair in kv.read_pages(pages) for a in pair)
        step(kv, [41])
        step(kv, [42])
        mx.eval(held)

    assert store_copies(kv, hit_evaluated_two_steps_later) < 0.5


def slow_steps(kv: PagedKV, first: int, n: int, wait: bool) -> None:
    """``n`` one-row steps whose store reads queue behind ~ms of other work, each launched at
    once (``wait``: once the previous step is done, as the engine launches a paged step)."""
    w = mx.random.normal((512, 512), key=mx.random.key(0))
    for i in range(n):
        batch = kv.step_batch([first + i])
        kv.begin_step(batch, 4 * N_IDS - 1)
        outs = []
        for layer in range(LAYERS):
            new = mx.ones((1, HEADS, 1, DIM))
            k, v = kv.write_read(layer, new, new, batch)
            outs.append((w @ w).sum() + k.sum() + v.sum())
        if wait:
            mx.synchronize()
        mx.async_eval(outs)


@pytest.mark.parametrize("wait", [True, False])
def test_a_step_copies_the_store_only_when_launched_before_the_previous_one_ran(wait: bool) -> None:
    """Why the engine waits (``launch_after_previous``): launched while the previous step's
    read of the store is still queued, a step's write copies the whole store; launched after,
    it writes in place. (If MLX ever writes in place past a pending read, the ahead case fails
    and the wait can go.)"""
    kv = PagedKV(LAYERS, BS, 4 * N_IDS)  # 32 MiB: well above the steps' own temporaries
    kv.put_row(0, prefilled(40, 0), table(0, 3))
    mx.eval(kv.store)
    copies = store_copies(kv, lambda: slow_steps(kv, 40, 8, wait))
    if wait:
        assert copies < 0.5
    else:
        assert copies >= 0.9
