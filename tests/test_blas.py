"""Choosing an optimized BLAS for MLX on Linux, and results agreeing with the bundled one."""

import json
import os
import platform
import shutil
import subprocess
import sys

import pytest

from veloxquant_mlx import blas

linux_only = pytest.mark.skipif(platform.system() != "Linux", reason="BLAS preload is Linux-only")

# Child script: matmul and the embedded model's logits for a fixed prompt, as JSON.
_COMPUTE = r"""
import json, sys
import mlx.core as mx
import mlx_lm
from veloxquant_mlx.blas import blas_in_use
a = mx.random.normal((256, 384), key=mx.random.key(3))
b = mx.random.normal((384, 320), key=mx.random.key(4))
model, tok = mlx_lm.load(sys.argv[1])
logits = model(mx.array([[1, 4, 205, 729, 578, 276, 6, 205, 5]]))[0, -1].astype(mx.float32)
print(json.dumps({"matmul": (a @ b).tolist(), "logits": logits.tolist(), "blas": blas_in_use()}))
"""


def _compute(model_dir, preload: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.ACTIVE_ENV)}
    if preload:
        env["LD_PRELOAD"] = preload
    out = subprocess.run(
        [sys.executable, "-c", _COMPUTE, str(model_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def broken_blas(tmp_path_factory):
    """A library whose cblas_sgemm aborts: a BLAS build that crashes on this CPU."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the broken library")
    d = tmp_path_factory.mktemp("broken")
    (d / "broken.c").write_text("#include <stdlib.h>\nvoid cblas_sgemm(void) { abort(); }\n")
    lib = d / "libbrokenblas.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(d / "broken.c")], check=True)
    return str(lib)


def _good() -> str:
    found = [p for p in blas.candidates() if blas.probe(p)]
    if not found:
        pytest.skip("no optimized BLAS on this machine (make installs libopenblas0-pthread)")
    return found[0]


def test_off_leaves_the_environment_alone(monkeypatch):
    monkeypatch.delenv(blas.ACTIVE_ENV, raising=False)
    before = dict(os.environ)
    assert blas.select("off") is None
    assert blas.ensure_blas("off") == "bundled"  # returned: no re-exec
    assert dict(os.environ) == before


@linux_only
def test_auto_picks_a_library_that_works():
    good = _good()
    assert blas.select("auto") == good
    assert blas.probe(good)


@linux_only
def test_a_crashing_or_bogus_candidate_is_skipped(broken_blas, tmp_path):
    good = _good()
    bogus = tmp_path / "libnotreally.so"
    bogus.write_text("not a shared library")
    assert not blas.probe(broken_blas)
    assert not blas.probe(str(bogus))
    assert blas.select("auto", find=lambda: [broken_blas, str(bogus), good]) == good
    assert blas.select("auto", find=lambda: [broken_blas]) is None


@linux_only
def test_explicit_path_must_exist_and_work(broken_blas):
    with pytest.raises(ValueError, match="no such file"):
        blas.select("/nonexistent/libblas.so")
    with pytest.raises(ValueError, match="does not run correctly"):
        blas.select(broken_blas)


def test_auto_falls_back_with_a_one_line_notice(monkeypatch):
    monkeypatch.delenv(blas.ACTIVE_ENV, raising=False)
    monkeypatch.setattr(blas, "candidates", lambda: [])
    notices: list[str] = []
    assert blas.ensure_blas("auto", log=notices.append) == "bundled"
    if platform.system() == "Linux":
        assert len(notices) == 1 and "\n" not in notices[0]


@linux_only
def test_results_agree_with_and_without(default_model_dir):
    good = _good()
    bundled = _compute(default_model_dir, None)
    optimized = _compute(default_model_dir, good)
    assert "openblas" not in bundled["blas"].lower()
    assert "openblas" in optimized["blas"].lower()
    for key, tol in (("matmul", 1e-3), ("logits", 2e-2)):
        a, b = bundled[key], optimized[key]
        flat_a = [x for row in a for x in row] if isinstance(a[0], list) else a
        flat_b = [x for row in b for x in row] if isinstance(b[0], list) else b
        assert max(abs(x - y) for x, y in zip(flat_a, flat_b, strict=True)) < tol, key


@linux_only
def test_this_suite_runs_on_the_optimized_blas():
    good = _good()
    if os.environ.get("VQ_BLAS") == "off":
        pytest.skip("suite run with VQ_BLAS=off")
    assert os.environ.get(blas.ACTIVE_ENV) == good
    import mlx.core as mx

    mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4)))
    assert "openblas" in blas.blas_in_use().lower()
