"""A layer's projections that read the same input run as one matmul.

An mlx_lm attention layer projects its input three times (``q_proj``, ``k_proj``,
``v_proj``) and its MLP twice (``gate_proj``, ``up_proj``), each a matmul of its own: five
launches a layer, and at one row each a matrix-vector product over a small matrix (an 8B
Llama's ``k_proj`` is 4,096 x 1,024), which reads memory less efficiently than one over the
whole. ``install`` concatenates each such group's weights (plain or quantized, with their
biases) into one ``nn.Linear`` or ``nn.QuantizedLinear`` and puts a ``FusedPart`` in each
member's place: the first part called with an input projects it through the whole (one
matmul) and hands each part its columns, so the model's own code, unchanged, makes two
matmuls a layer where it made five. A part called with an input the group has not projected
(a model that projects different inputs) projects that input itself, so the result is the
same whatever the model's order of calls; a group's columns are dropped once every part took
its own. It is kept only where a probe forward gives the same logits as before (within the
dtype's rounding), and never for a sharded model (its projections are not plain linears).
Engine thread only (the parts share their group's last input).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger("veloxquant.engine")

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_ARRAYS = ("weight", "scales", "biases", "bias")  # what a (quantized) linear may hold


class _Group:
    """One fused group: the whole linear, where each part's columns start, and the last
    input it projected with the parts not yet taken."""

    __slots__ = ("cuts", "left", "linear", "parts", "x")

    def __init__(self, linear: nn.Module, widths: Sequence[int]) -> None:
        self.linear = linear
        self.cuts = list(itertools.accumulate(widths))[:-1]
        self.x: mx.array | None = None
        self.parts: list[mx.array] = []
        self.left = 0

    def take(self, x: mx.array, index: int) -> mx.array:
        if self.x is not x or not self.left:
            self.parts = list(mx.split(self.linear(x), self.cuts, axis=-1))
            self.x, self.left = x, len(self.parts)
        out = self.parts[index]
        self.left -= 1
        if not self.left:  # every part took its columns: hold nothing past the layer
            self.x, self.parts = None, []
        return out


class FusedPart(nn.Module):
    """One member of a fused group in its old place: its columns of the group's projection.
    The group's first part holds the whole linear (``fused``), so the model's parameters
    hold each weight once."""

    def __init__(self, group: _Group, index: int) -> None:
        super().__init__()
        self._group = group
        self._index = index
        if index == 0:
            self.fused = group.linear

    def __call__(self, x: mx.array) -> mx.array:
        return self._group.take(x, self._index)


def _fusable(members: list[Any]) -> bool:
    """Plain linears of one input width, or quantized ones of one input width and one
    quantization; with biases in all or none."""
    first = members[0]
    kind = type(first)
    if kind not in (nn.Linear, nn.QuantizedLinear) or any(type(m) is not kind for m in members):
        return False
    if any(("bias" in m) != ("bias" in first) for m in members):
        return False
    if any(m.weight.shape[1:] != first.weight.shape[1:] for m in members):
        return False
    if kind is nn.QuantizedLinear:
        same = ("group_size", "bits", "mode")
        if any(getattr(m, a) != getattr(first, a) for m in members for a in same):
            return False
        if any(("biases" in m) != ("biases" in first) for m in members):
            return False
    return True


def _fuse(members: list[Any]) -> nn.Module:
    first = members[0]
    quantized = type(first) is nn.QuantizedLinear
    if quantized:
        whole: nn.Module = nn.QuantizedLinear(
            first.group_size, 1, "bias" in first, first.group_size, first.bits, first.mode
        )
        if "biases" not in first:
            whole.pop("biases", None)
    else:
        whole = nn.Linear(1, 1, bias="bias" in first)
    for name in _ARRAYS:
        if name in first:
            setattr(whole, name, mx.concatenate([m[name] for m in members], axis=0))
    if quantized:
        whole.freeze()
    return whole


def _groups(model: Any) -> list[tuple[Any, tuple[str, ...], list[Any]]]:
    """(module, names, members) for each group of projections ``install`` can fuse."""
    found: list[tuple[Any, tuple[str, ...], list[Any]]] = []
    for _, module in model.named_modules():
        for names in GROUPS:
            members = [module.get(n) if isinstance(module, dict) else None for n in names]
            if all(isinstance(m, nn.Module) for m in members) and _fusable(members):
                found.append((module, names, members))
    return found


def install(model: Any) -> int:
    """Fuse ``model``'s projection groups in place. Returns how many groups it fused (0: the
    model as it was, also where the probe's logits differ)."""
    groups = _groups(model)
    if not groups:
        return 0
    probe = mx.array([[1, 5, 9, 13, 2, 7, 3, 11]])
    before = model(probe)
    mx.eval(before)
    for module, names, members in groups:
        whole = _fuse(members)
        mx.eval(whole.parameters())
        group = _Group(whole, [m.weight.shape[0] for m in members])
        for member, start, end in zip(members, [0, *group.cuts], [*group.cuts, None], strict=True):
            for array in _ARRAYS:  # the member's own arrays, freed: views of the whole's
                if array in member:
                    member[array] = whole[array][start:end]
        for i, name in enumerate(names):
            setattr(module, name, FusedPart(group, i))
    after = model(probe)
    tolerance = 1e-4 if before.dtype == mx.float32 else 5e-2
    scale = float(mx.abs(before).max()) or 1.0
    gap = float(mx.abs(after.astype(mx.float32) - before.astype(mx.float32)).max()) / scale
    if gap <= tolerance:
        log.info("fused %d projection groups (one matmul for q/k/v, one for gate/up)", len(groups))
        return len(groups)
    for module, names, members in groups:  # not the same logits: the model as it was
        for name, member in zip(names, members, strict=True):
            setattr(module, name, member)  # (its arrays are views of the fused weights)
    log.info("projections kept apart: fused, the probe's logits moved %.2g of their scale", gap)
    return 0
