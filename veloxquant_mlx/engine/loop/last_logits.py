"""A prompt's forward computes the output head for the one position it samples from.

An mlx_lm model is ``h = self.model(inputs, cache)`` followed by a position-wise head (the
final projection to the vocabulary, tied or not, with any soft-capping or scaling), and it
projects every position: a cached agent turn of 128 new tokens makes 128 rows of logits and
samples from the last. Where the vocabulary is large that projection is a large share of the
forward (Llama-3.2-1B: 263M of its 1.24B weights; Qwen2.5-0.5B: 136M of 494M). ``install``
gives the model's inner module a class of its own whose call returns only the position asked
for (``position``), so the head runs on that row alone; outside ``position`` the model is
unchanged (decode steps, prompt scoring). It is installed only where a probe forward gives
the same logits both ways, so a model whose outer call is not position-wise keeps its own.
Engine thread only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn

_ATTR = "_vq_position"  # on the inner module: the position its call returns, or None


def install(model: Any) -> bool:
    """Let ``position`` cut ``model``'s hidden states to one position before its head.
    Returns whether it did: not for a model without an inner ``model`` module, nor for one
    whose logits differ, or whose call fails, when cut (checked on a short prompt)."""
    inner = getattr(model, "model", None)
    if not isinstance(inner, nn.Module):
        return False
    if hasattr(inner, _ATTR):  # installed already
        return True
    base = type(inner)

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = base.__call__(self, *args, **kwargs)
        at = getattr(self, _ATTR)
        if at is None or not isinstance(out, mx.array) or out.ndim != 3:
            return out
        return out[:, at : at + 1, :]

    cut = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__})
    inner.__class__ = cut
    setattr(inner, _ATTR, None)
    try:
        if _same_logits(model):
            return True
    except Exception:  # an outer call that cannot take one position: the model as it was
        pass
    inner.__class__ = base  # not position-wise after all: the model as it was
    delattr(inner, _ATTR)
    return False


@contextlib.contextmanager
def position(model: Any, at: int) -> Iterator[None]:
    """Within, ``model(...)`` returns the logits of position ``at`` (>= 0) alone (``[B, 1,
    V]``) where ``install`` took; elsewhere every position's, as always (``row`` picks the
    row either way)."""
    assert at >= 0, "a position from the start"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, _ATTR):
        yield
        return
    setattr(inner, _ATTR, at)
    try:
        yield
    finally:
        setattr(inner, _ATTR, None)


def row(logits: mx.array, at: int) -> mx.array:
    """The logits of position ``at`` from a forward run under ``position(model, at)``."""
    return logits[:, 0 if logits.shape[1] == 1 else at, :]


def _same_logits(model: Any) -> bool:
    """A short prompt's logits at one position, cut and not: the same up to the rounding of a
    product of another shape (a head that mixes positions would differ grossly)."""
    tokens = mx.array([[1, 2, 3, 4, 5]])
    full = model(tokens)
    with position(model, 2):
        cut = model(tokens)
    if cut.shape != (full.shape[0], 1, full.shape[2]):
        return False
    tol = 1e-3 if full.dtype == mx.float32 else 5e-2
    a, b = full[:, 2].astype(mx.float32), cut[:, 0].astype(mx.float32)
    return bool(mx.allclose(a, b, rtol=tol, atol=tol).item())
