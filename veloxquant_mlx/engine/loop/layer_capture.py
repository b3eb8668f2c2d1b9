"""A prefill forward's hidden state after each decoder layer, for launching it in parts.

MLX builds a forward lazily and runs what ``mx.async_eval`` is given and what that needs: the
hidden state after layer ``k`` needs layers ``0..k`` only (their caches' writes included, which
their attention reads). So a chunk's forward, built once, can be launched a few layers at a
time, one part per engine turn, with the decode steps of the running rows between
(``--prefill-parts``, ``engine.loop.prefill``). ``install`` gives each of the model's decoder
layers a class of its own that hands its output to a sink while ``capturing`` is on; outside
it the layers are unchanged. Engine thread only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

_ATTR = "_vq_sink"  # on each layer: the list its outputs go to, or None
_CLASSES: dict[type, type] = {}  # a layer class -> its capturing subclass


def _capturing_class(base: type) -> type:
    sub = _CLASSES.get(base)
    if sub is None:

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = base.__call__(self, *args, **kwargs)
            sink = getattr(self, _ATTR, None)
            if sink is not None:
                sink.append(out)
            return out

        sub = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__})
        _CLASSES[base] = sub
    return sub


def install(model: Any) -> bool:
    """Let ``capturing`` collect ``model``'s decoder layers' outputs. Returns whether it
    could: not for a model without a ``layers`` list. Idempotent. O(layers)."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, list) or not layers:
        return False
    for layer in layers:
        if not hasattr(layer, _ATTR):
            layer.__class__ = _capturing_class(type(layer))
            setattr(layer, _ATTR, None)
    return True


@contextlib.contextmanager
def capturing(model: Any, on: bool = True) -> Iterator[list[Any]]:
    """Within, every call of ``model``'s decoder layers appends its output to the list
    yielded (empty where ``on`` is False or nothing was installed)."""
    sink: list[Any] = []
    layers = [x for x in getattr(model, "layers", None) or [] if hasattr(x, _ATTR)] if on else []
    for layer in layers:
        setattr(layer, _ATTR, sink)
    try:
        yield sink
    finally:
        for layer in layers:
            setattr(layer, _ATTR, None)


def stages(outputs: list[Any], n_layers: int, parts: int) -> list[mx.array]:
    """The hidden states that end each of the first ``parts - 1`` of ``parts`` even runs of
    layers (each launched in a turn of its own; the last part is the forward's own launch).
    Empty where the layers' outputs are not one array each (a layer returning more, a model
    calling its layers otherwise): such a forward is launched whole."""
    if parts < 2 or len(outputs) != n_layers or not all(isinstance(o, mx.array) for o in outputs):
        return []
    ends = sorted({n_layers * i // parts for i in range(1, parts)} - {0, n_layers})
    return [outputs[end - 1] for end in ends]
