"""One-row products through numpy's sgemv (``engine.model.host_gemv``): the same logits as
MLX's at one row, MLX's own route for more rows, float32 only; in the engine a one-row step
goes op by op while steps of more rows stay compiled, with the tokens of an engine without."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import _get_classes

from veloxquant_mlx.engine.hosts.thread import EngineConfig
from veloxquant_mlx.engine.model import host_gemv
from veloxquant_mlx.engine.model.default_model import CONFIG
from veloxquant_mlx.engine.types import GenerationRequest, SamplingParams


def make(dtype=mx.float32):
    model_class, args_class = _get_classes(CONFIG)
    mx.random.seed(5)
    model = model_class(args_class.from_dict(CONFIG))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def greedy(model, prompt: list[int], n: int) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def test_one_row_through_numpy_with_the_same_logits_and_tokens():
    model = make()
    one, rows = mx.array([[7]]), mx.array([[7, 8, 9], [3, 4, 5]])
    before_one, before_rows = model(one), model(rows)
    tokens = greedy(model, [5, 9, 11, 40], 16)
    routed = [m for _, m in model.named_modules() if type(m) in (nn.Linear, nn.Embedding)]
    assert host_gemv.install(model) == 0  # the tiny model's weights are too few in all
    assert not host_gemv.installed(model)
    n = host_gemv.install(model, smallest=0, in_all=0)
    assert n == len(routed) > 0
    assert host_gemv.installed(model)
    assert type(model.model.layers[0].mlp.down_proj) is host_gemv.HostLinear
    assert type(model.model.embed_tokens) is host_gemv.HostEmbedding  # a tied head's product
    assert mx.allclose(model(one), before_one, rtol=1e-5, atol=1e-5).item()
    assert mx.array_equal(model(rows), before_rows).item()  # more rows: MLX's product
    assert greedy(model, [5, 9, 11, 40], 16) == tokens


def test_only_float32_weights():
    model = make(mx.bfloat16)
    assert host_gemv.install(model, smallest=0, in_all=0) == 0
    assert not host_gemv.installed(model)


def test_the_engine_steps_one_row_eagerly_and_more_rows_compiled(make_engine, monkeypatch):
    monkeypatch.setattr(host_gemv, "SMALLEST", 0)
    monkeypatch.setattr(host_gemv, "LEAST_IN_ALL", 0)
    prompts = [tuple(range(5 + i, 25 + i)) for i in range(3)]
    results = {}
    for mode in ("on", "off"):
        engine = make_engine(host_gemv=mode, compiled_step="on")
        runner = engine._core.runner
        assert runner.eager_one_row == (mode == "on")
        greedy_ = SamplingParams(temperature=0.0)
        alone = engine.submit(GenerationRequest(prompts[0], 12, greedy_)).collect(30)[0]
        handles = [engine.submit(GenerationRequest(p, 12, greedy_)) for p in prompts]
        together = [h.collect(30)[0] for h in handles]
        results[mode] = [[t.token_id for t in alone]] + [[t.token_id for t in r] for r in together]
        assert runner.compiled is not None and runner.compiled.failed is None
    assert results["on"] == results["off"]


@pytest.mark.parametrize("value", ["maybe", "1"])
def test_the_setting_refuses_other_values(value):
    from pydantic import ValidationError

    from veloxquant_mlx.config import Settings

    with pytest.raises(ValidationError):
        Settings(host_gemv=value)
    assert EngineConfig().host_gemv == "auto"
