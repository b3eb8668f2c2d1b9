"""A one-row product with a float32 linear's weight computed by numpy on a CPU.

MLX's CPU backend makes every matmul a BLAS ``sgemm``, also for one row (a single stream's
decode step), and OpenBLAS's ``sgemm`` packs the whole weight for it: a 105M-parameter
model's products at one row took 30 ms a step on this CPU where numpy's ``sgemv`` over the
same weights (``np.dot``, its own OpenBLAS) took 16 ms. ``install`` gives each float32
``nn.Linear`` of a model large enough for it to matter a class of its own whose call, for an
input of one row, evaluates the input and multiplies through a numpy view of the weight (no
copy), and each such ``nn.Embedding`` the same for its use as a tied output head
(``as_linear``); any other input goes through MLX as before. A product through numpy evaluates its
input, so the forward runs op by op at one row, and it cannot be traced: the runner steps a
one-row batch eagerly where this is installed (``installed``). Kept only where a one-token
probe forward gives the same logits as through MLX (within float32's rounding). Engine
thread only.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

log = logging.getLogger("veloxquant.engine")

SMALLEST = 256 * 1024  # weights of fewer elements go through MLX (a call's cost is their time)
# Routed weights a model must have in all: below, the forward's syncs at every product cost
# more than the products save (the embedded 3.4M-parameter model: a one-row step 2.7 ms this
# way against 1.6 compiled; the 105M one: 26-28 ms against 36)
LEAST_IN_ALL = 32 * 2**20
TOLERANCE = 1e-4  # of the probe's logit scale: float32's rounding, summed in another order
_ATTR = "_vq_host"  # on the model: how many linears ``install`` gave the numpy route


class HostLinear(nn.Linear):
    """An ``nn.Linear`` whose one-row products run through numpy's ``sgemv``."""

    _host: np.ndarray  # the weight, a view of MLX's buffer
    _host_bias: np.ndarray | None

    def __call__(self, x: mx.array) -> mx.array:
        if x.size != x.shape[-1] or x.dtype != mx.float32:
            return super().__call__(x)
        y = np.dot(self._host, np.asarray(x).reshape(-1))
        if self._host_bias is not None:
            y += self._host_bias
        return mx.array(y).reshape(*x.shape[:-1], y.shape[0])


class HostEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose one-row products as the output head (``as_linear``, tied
    weights) run through numpy's ``sgemv``."""

    _host: np.ndarray

    def as_linear(self, x: mx.array) -> mx.array:
        if x.size != x.shape[-1] or x.dtype != mx.float32:
            return super().as_linear(x)
        y = np.dot(self._host, np.asarray(x).reshape(-1))
        return mx.array(y).reshape(*x.shape[:-1], y.shape[0])


_ROUTED: dict[type, type] = {nn.Linear: HostLinear, nn.Embedding: HostEmbedding}


def wanted(mode: str) -> bool:
    """``--host-gemv``: "on", "off", or "auto": on with a CPU."""
    if mode == "auto":
        return mx.default_device() == mx.cpu
    return mode == "on"


def install(model: Any, smallest: int | None = None, in_all: int | None = None) -> int:
    """Give every float32 ``nn.Linear`` of ``model`` with at least ``smallest`` weights
    (``SMALLEST`` if None), and each such ``nn.Embedding`` for a tied head's ``as_linear``,
    the numpy route for one row, if they hold ``in_all`` weights (``LEAST_IN_ALL`` if None).
    Returns how many (0: too few weights, a model in another dtype, or a probe whose logits
    moved). The weights must be evaluated and stay as they are
    (views of them are kept)."""
    least = SMALLEST if smallest is None else smallest
    chosen = [
        module
        for _, module in model.named_modules()
        if type(module) in _ROUTED
        and module.weight.dtype == mx.float32
        and module.weight.size >= least
    ]
    enough = LEAST_IN_ALL if in_all is None else in_all
    if not chosen or sum(module.weight.size for module in chosen) < enough:
        setattr(model, _ATTR, 0)
        return 0
    probe = mx.array([[5]])  # one token: every product of the forward has one row
    one = model(probe)
    mx.eval(one)
    kinds = [type(module) for module in chosen]
    for module in chosen:
        module.__class__ = _ROUTED[type(module)]
        module._host = np.asarray(module.weight)
        if isinstance(module, HostLinear):
            bias = module.get("bias")
            module._host_bias = None if bias is None else np.asarray(bias)
    after = model(probe)
    scale = float(mx.abs(one).max()) or 1.0
    gap = float(mx.abs(after - one).max()) / scale
    if gap > TOLERANCE:  # not the same logits: the model as it was
        for module, kind in zip(chosen, kinds, strict=True):
            module.__class__ = kind
        log.info("one-row products kept in MLX: numpy's moved the probe's logits %.2g", gap)
        setattr(model, _ATTR, 0)
        return 0
    setattr(model, _ATTR, len(chosen))
    log.info("one-row products of %d float32 linears through numpy (sgemv)", len(chosen))
    return len(chosen)


def installed(model: Any) -> bool:
    """Whether ``install`` gave some of ``model``'s linears the numpy route."""
    return bool(getattr(model, _ATTR, 0))
