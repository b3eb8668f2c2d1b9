"""Choosing an optimized BLAS for MLX on Linux, and results agreeing with the bundled one."""

import json
import os
import platform
import shutil
import subprocess
import sys

import pytest

from veloxquant_mlx import blas, gemv_forward

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
    assert os.environ.get(blas.ACTIVE_ENV, "").split(" + ")[0] == good
    import mlx.core as mx

    mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4)))
    assert "openblas" in blas.blas_in_use().lower()


# A forwarder that claims to forward but computes nothing: the probe must refuse it.
_WRONG_FORWARDER = r"""
void cblas_sgemm(int o, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    for (int i = 0; i < m; i++) for (int j = 0; j < n; j++) c[i * ldc + j] = 0.0f;
}
unsigned long vq_gemv_forwarded(void) { return 1; }
"""

# Child script: every one-row / one-column / few-row product layout MLX hands to cblas_sgemm,
# against the elementwise definition, with the number of products the forwarder computed.
_VECTOR_PRODUCTS = r"""
import ctypes, json, sys
import mlx.core as mx
worst, n = 0.0, 0
shapes = [(1, 768, 3072), (1, 3072, 768), (40, 64, 1), (1, 1, 1), (1, 7, 1)]
shapes += [(m, k, 200) for m in range(2, 10) for k in (8, 67, 768)]  # a few rows, odd k
shapes += [(m, 768, 520) for m in (2, 5, 8)]  # large enough to be shared between threads
for m, k, n_ in shapes:
    for ta in (False, True):
        for tb in (False, True):
            n += 1
            a = mx.random.normal((k, m) if ta else (m, k), key=mx.random.key(n))
            b = mx.random.normal((n_, k) if tb else (k, n_), key=mx.random.key(100 + n))
            a, b = (a.T if ta else a), (b.T if tb else b)
            want = (a[:, :, None] * b[None, :, :]).sum(axis=1)
            worst = max(worst, mx.max(mx.abs(a @ b - want)).item())
            batched = mx.stack([a, 2 * a]) @ b  # MLX folds the batch: two rows, sgemm
            worst = max(worst, mx.max(mx.abs(batched[1] - 2 * want)).item())
print(json.dumps({"worst": worst, "forwarded": ctypes.CDLL(sys.argv[1]).vq_gemv_forwarded()}))
"""


@pytest.fixture(scope="module")
def forwarder(tmp_path_factory):
    if gemv_forward.compiler() is None:
        pytest.skip("needs a C compiler to build the gemv forwarder")
    return str(gemv_forward.build(tmp_path_factory.mktemp("gemv")))


def test_the_forwarder_is_built_once_per_source(tmp_path):
    if gemv_forward.compiler() is None:
        pytest.skip("needs a C compiler")
    first = gemv_forward.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert gemv_forward.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert "blas" in first.name and not list(tmp_path.glob("*.partial"))


def test_a_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(RuntimeError, match="no-such-cc failed"):
        gemv_forward.build(tmp_path)
    assert not list(tmp_path.iterdir())


@linux_only
def test_the_forwarder_computes_few_row_products_right(forwarder):
    good = _good()
    assert blas.probe(good, forwarder=forwarder)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.ACTIVE_ENV)}
    env["LD_PRELOAD"] = f"{forwarder}:{good}"
    out = subprocess.run(
        [sys.executable, "-c", _VECTOR_PRODUCTS, forwarder],
        env=env, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["worst"] < 1e-3
    # each unbatched product with one row or column, or 2-8 rows against a transposed matrix
    assert result["forwarded"] >= 5 * 4 + 7 * 3 * 2 + 3 * 2


@linux_only
def test_a_forwarder_that_computes_wrong_fails_the_probe(tmp_path):
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    (tmp_path / "wrong.c").write_text(_WRONG_FORWARDER)
    lib = tmp_path / "libwrong.so"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "wrong.c")], check=True
    )
    assert not blas.probe(_good(), forwarder=str(lib))


@linux_only
def test_the_model_agrees_with_and_without_the_forwarder(default_model_dir, forwarder):
    good = _good()
    alone = _compute(default_model_dir, good)
    forwarded = _compute(default_model_dir, f"{forwarder}:{good}")
    assert "libvqblas-gemv" in forwarded["blas"] and "libvqblas-gemv" not in alone["blas"]
    worst = max(abs(x - y) for x, y in zip(alone["logits"], forwarded["logits"], strict=True))
    assert worst < 1e-3
