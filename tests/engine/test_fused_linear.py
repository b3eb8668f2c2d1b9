"""A layer's projections that read one input run as one matmul (``engine.model.fused_linear``):
fused on every architecture the layout tests serve, plain and quantized, with and without
biases; the same logits as the model before; each weight held once; nothing held past a
forward; a part called with an input its group has not projected projects it itself."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

from tests.engine.test_layouts import ARCHS
from veloxquant_mlx.engine.model import fused_linear
from veloxquant_mlx.engine.model.default_model import CONFIG

KINDS = {**ARCHS, "qwen2_biased": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}}
TOKENS = mx.array([[5, 9, 11, 40, 7, 3, 100, 2, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9]])


def make(kind: str, quantized: bool = False):
    config = {**CONFIG, **KINDS[kind]}
    model_class, args_class = _get_classes(config)
    mx.random.seed(3)
    model = model_class(args_class.from_dict(config))
    if quantized:

        def whole_groups(_: str, m: nn.Module) -> bool:  # (the tiny MLP's width is not)
            return hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0

        nn.quantize(model, 32, 4, class_predicate=whole_groups)
    mx.eval(model.parameters())
    return model


def sizes(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


@pytest.mark.parametrize("quantized", [False, True], ids=["plain", "4-bit"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fused_with_the_same_logits_and_each_weight_once(kind, quantized):
    model = make(kind, quantized)
    before, held = model(TOKENS), sizes(model)
    n_layers = len(model.model.layers)
    assert fused_linear.install(model) == 2 * n_layers
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert all(isinstance(m, fused_linear.FusedPart) for m in (attn.q_proj, attn.v_proj))
    assert isinstance(mlp.up_proj, fused_linear.FusedPart)
    whole = attn.q_proj.fused
    assert isinstance(whole, nn.QuantizedLinear if quantized else nn.Linear)
    if kind == "qwen2_biased":
        assert "bias" in whole and whole.bias.shape == (whole.weight.shape[0],)
    assert sizes(model) == held  # the fused weights once, the members hold none
    after = model(TOKENS)
    assert after.shape == before.shape
    assert mx.allclose(after, before, atol=1e-5, rtol=1e-5).item()
    assert attn.q_proj._group.x is None and not attn.q_proj._group.parts  # nothing held


def test_a_part_projects_an_input_its_group_has_not():
    mx.random.seed(1)
    q, k, v = nn.Linear(16, 8), nn.Linear(16, 4), nn.Linear(16, 4)
    holder = nn.Module()
    holder.q_proj, holder.k_proj, holder.v_proj = q, k, v
    a, b = mx.random.normal((2, 3, 16)), mx.random.normal((2, 3, 16))
    expected = (q(a), k(b), v(a), v(b))
    group = fused_linear._Group(fused_linear._fuse([q, k, v]), [8, 4, 4])
    parts = [fused_linear.FusedPart(group, i) for i in range(3)]
    got = (parts[0](a), parts[1](b), parts[2](a), parts[2](b))  # k and the last v on b
    for x, y in zip(got, expected, strict=True):
        assert mx.allclose(x, y, atol=1e-6).item()


def test_members_that_differ_are_left_apart():
    mx.random.seed(1)
    model = nn.Module()
    model.layer = nn.Module()
    model.layer.gate_proj = nn.Linear(16, 8, bias=True)
    model.layer.up_proj = nn.Linear(16, 8, bias=False)  # a bias in one only
    model.layer.q_proj = nn.Linear(16, 8)
    model.layer.k_proj = nn.QuantizedLinear(32, 8, group_size=32, bits=4)  # another kind
    model.layer.v_proj = nn.Linear(16, 8)
    assert fused_linear._groups(model) == []
