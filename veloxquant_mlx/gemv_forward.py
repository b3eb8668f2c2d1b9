"""The gemv forwarder preloaded in front of an optimized BLAS (the ``--blas-gemv`` setting).

MLX's CPU backend computes every float32 matmul with ``cblas_sgemm``. OpenBLAS's sgemm packs the
weight matrix before multiplying, which for a product with one row (every matmul of a decode step
of one sequence) reads the weights about twice; ``native/gemv_forward.c`` sends products with one
row or one column to ``cblas_sgemv`` instead, and everything else to sgemm unchanged. A
105M-parameter model's one-sequence decode step goes from 52 to 33 ms (BENCHMARKS.md).

The library is compiled from the shipped source with the system C compiler (``$CC``, ``cc`` or
``gcc``) on first use, into the cache directory, named by the source's hash, and probed in a child
process like any BLAS (``blas.probe``): it must multiply right and must have forwarded. Without a
compiler the server runs on the BLAS alone and says so. Imports no MLX.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from veloxquant_mlx.config.paths import default_cache_dir

SOURCE = Path(__file__).parent / "native" / "gemv_forward.c"
# The name keeps "blas" in it so ``blas.blas_in_use`` lists it among the libraries in use.
_PREFIX = "libvqblas-gemv-"


def compiler() -> str | None:
    """The C compiler to build with: ``$CC`` if set, else ``cc`` or ``gcc`` on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(directory: Path | None = None) -> Path:
    """The forwarder library for the shipped source, compiled into ``directory`` if not there.

    Raises:
        RuntimeError: No C compiler, or it failed (the message carries its output's tail).
    """
    source = SOURCE.read_bytes()
    target = (
        directory or default_cache_dir()
    ) / f"{_PREFIX}{hashlib.sha256(source).hexdigest()[:12]}.so"
    if target.is_file():
        return target
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    cmd = [cc, "-O2", "-shared", "-fPIC", "-o", str(partial), str(SOURCE), "-ldl"]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"{cc} failed: {exc}") from None
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"{cc} failed: {(result.stderr or result.stdout)[-500:]}")
    os.replace(partial, target)  # atomic: a concurrent start sees the whole library or none
    return target
