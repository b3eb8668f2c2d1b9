"""A prompt's forward projects only the position it samples from (``engine.loop.last_logits``):
installed on every architecture the layout tests serve (whose tokens stay stock's there), the
same logits as the full forward's row, the model unchanged outside, and refused for a model
whose outer call mixes positions."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.utils import _get_classes

from tests.engine.test_layouts import ARCHS
from veloxquant_mlx.engine.loop import last_logits
from veloxquant_mlx.engine.model.default_model import CONFIG


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_installed_and_the_same_logits_as_the_full_forward(arch):
    config = {**CONFIG, **ARCHS[arch]}
    model_class, args_class = _get_classes(config)
    mx.random.seed(3)
    model = model_class(args_class.from_dict(config))
    tokens = mx.array([[5, 9, 11, 40, 7, 3, 100, 2, 8]])
    full = model(tokens)
    assert last_logits.install(model) and last_logits.install(model)  # idempotent
    for at in (0, 4, 8):
        with last_logits.position(model, at):
            cut = model(tokens)
        assert cut.shape == (1, 1, full.shape[-1])
        assert mx.allclose(last_logits.row(cut, at), full[:, at], atol=1e-5).item()
    assert model(tokens).shape == full.shape  # outside: every position, as before
    assert mx.array_equal(model(tokens), full).item()


class _Mixing(nn.Module):
    """An inner module and an outer call whose logits mix positions (a cumulative sum)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50)

    def __call__(self, tokens: mx.array) -> mx.array:
        return self.head(mx.cumsum(self.model(tokens), axis=1))


def test_refused_where_the_head_is_not_position_wise():
    model = _Mixing()
    inner_class = type(model.model)
    before = model(mx.array([[1, 2, 3, 4, 5]]))
    assert not last_logits.install(model)
    assert type(model.model) is inner_class  # as it was
    with last_logits.position(model, 2):  # a no-op there: every position, as always
        out = model(mx.array([[1, 2, 3, 4, 5]]))
    assert out.shape == before.shape
    assert mx.allclose(last_logits.row(out, 2), before[:, 2]).item()


def test_a_model_without_an_inner_module_is_left_alone():
    model = nn.Linear(4, 4)
    assert not last_logits.install(model)
    with last_logits.position(model, 0):
        assert model(mx.ones((1, 3, 4))).shape == (1, 3, 4)


def test_the_engine_installs_it(make_engine):
    engine = make_engine(kv_cache_mb=32)
    inner = engine._core.runner.model.model
    assert getattr(inner, "_vq_position", "absent") is None  # installed, and not cutting now


class _Strict(nn.Module):
    """An outer call that raises unless it has every position of the inner output."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Embedding(50, 8)

    def __call__(self, tokens: mx.array) -> mx.array:
        h = self.model(tokens)
        if h.shape[1] != tokens.shape[1]:
            raise ValueError("every position is needed here")
        return h


def test_refused_where_the_cut_call_fails():
    model = _Strict()
    inner_class = type(model.model)
    assert not last_logits.install(model)
    assert type(model.model) is inner_class and not hasattr(model.model, "_vq_position")
