"""The gemv forwarder preloaded in front of an optimized BLAS (the ``--blas-gemv`` setting).

MLX's CPU backend computes every float32 matmul with ``cblas_sgemm``. OpenBLAS's sgemm packs the
weight matrix before multiplying, which for the few-row products of a decode step reads the
weights about twice. ``native/gemv_forward.c`` computes those itself: one row (or column) with
``cblas_sgemv``, 2-8 rows against a transposed matrix (``x @ W.T``) with a kernel that streams the
weights once, on one thread per core; everything else goes to sgemm unchanged. A 105M-parameter
model's decode step: 52 -> 31 ms for one sequence, 65 -> 45 ms for four, 72 -> 63 ms for eight
(BENCHMARKS.md).

The library is compiled from the shipped source with the system C compiler (``$CC``, ``cc`` or
``gcc``; ``-O3 -march=native``, as it runs where it is built) on first use, into the cache
directory, named by a hash of the source, the flags and the CPU, and probed in a child process like
any BLAS (``blas.probe``): it must multiply right and must have forwarded. Without a compiler the
server runs on the BLAS alone and says so. ``VQ_GEMV_THREADS`` sets its thread count (default: the
online cores). Imports no MLX.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

from veloxquant_mlx.config.paths import default_cache_dir

SOURCE = Path(__file__).parent / "native" / "gemv_forward.c"
# The name keeps "blas" in it so ``blas.blas_in_use`` lists it among the libraries in use.
_PREFIX = "libvqblas-gemv-"
_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC"]


def compiler() -> str | None:
    """The C compiler to build with: ``$CC`` if set, else ``cc`` or ``gcc`` on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(directory: Path | None = None) -> Path:
    """The forwarder library for the shipped source, compiled into ``directory`` if not there.

    Raises:
        RuntimeError: No C compiler, or it failed (the message carries its output's tail).
    """
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(_FLAGS).encode() + _cpu().encode()).hexdigest()[:12]
    target = (directory or default_cache_dir()) / f"{_PREFIX}{key}.so"
    if target.is_file():
        return target
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    error = ""
    for flags in (_FLAGS, [f for f in _FLAGS if f != "-march=native"]):
        cmd = [cc, *flags, "-o", str(partial), str(SOURCE), "-ldl", "-lpthread"]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"{cc} failed: {exc}") from None
        if result.returncode == 0:
            os.replace(partial, target)  # atomic: a concurrent start sees all of it or nothing
            return target
        error = (result.stderr or result.stdout)[-500:]
    partial.unlink(missing_ok=True)
    raise RuntimeError(f"{cc} failed: {error}")


def _cpu() -> str:
    """What the CPU is, for the library's name: a cache shared between machines keeps one each."""
    try:
        with open("/proc/cpuinfo") as fh:
            lines = [line for line in fh if line.startswith(("model name", "flags"))]
        return platform.machine() + "".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()
