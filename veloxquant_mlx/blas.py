"""Make MLX's CPU backend use an optimized BLAS on Linux (the ``--blas`` setting).

The ``mlx[cpu]`` Linux wheel bundles netlib's reference BLAS: matrix products run 20-50x slower
than with OpenBLAS. MLX resolves ``cblas_*`` symbols at load time, so preloading an optimized
library (``LD_PRELOAD``) before Python starts makes MLX use it. ``ensure_blas`` does that by
re-executing the current process once with the library preloaded.

``auto`` probes candidate libraries, each in a child process (a build that crashes, or computes
wrong results, on this CPU is skipped) and falls back to the bundled library with a one-line
notice; ``off`` changes nothing; a path preloads that library (still probed). Never on macOS:
MLX uses Accelerate and Metal there. Imports no MLX itself.
"""

from __future__ import annotations

import glob
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence

# Set in the re-executed child so it does not re-execute again; holds the chosen library.
ACTIVE_ENV = "VQ_BLAS_ACTIVE"
_PATTERNS = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas*.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
    "/opt/homebrew/opt/openblas/lib/libopenblas.so",
)
# Runs in the probe child: products MLX must compute right (general, one row, one column, a few
# rows, transposed operands), and proof the library (and the gemv forwarder, if given) is
# mapped and used.
_PROBE = r"""
import ctypes, sys
import mlx.core as mx
def check(a, b):
    want = (a[:, :, None] * b[None, :, :]).sum(axis=1)
    return mx.allclose(a @ b, want, rtol=1e-4, atol=1e-4).item()
key = iter(range(1, 100))
def rand(*shape):
    return mx.random.normal(shape, key=mx.random.key(next(key)))
ok = check(rand(96, 80), rand(80, 72))
for m, k, n in ((1, 80, 72), (96, 80, 1), (1, 80, 1), (1, 1, 5), (2, 80, 72), (5, 83, 131),
                (8, 256, 96), (4, 512, 520)):
    ok = ok and check(rand(m, k), rand(k, n)) and check(rand(k, m).T, rand(n, k).T)
    ok = ok and check(rand(m, k), rand(n, k).T) and check(rand(k, m).T, rand(k, n))
maps = open("/proc/self/maps").read()
ok = ok and all(path in maps for path in sys.argv[1:])
if len(sys.argv) > 2:
    ok = ok and ctypes.CDLL(sys.argv[2]).vq_gemv_forwarded() > 0
sys.exit(0 if ok else 3)
"""


def candidates() -> list[str]:
    """Optimized BLAS libraries found on this machine, most preferred first (no duplicates)."""
    found: list[str] = []
    for pattern in _PATTERNS:
        for path in sorted(glob.glob(pattern)):
            real = os.path.realpath(path)
            if real not in {os.path.realpath(p) for p in found}:
                found.append(path)
    return found


def probe(path: str, timeout: float = 120.0, forwarder: str | None = None) -> bool:
    """True if MLX, with ``path`` preloaded in a child process, maps it and multiplies right.

    With ``forwarder`` (the gemv forwarder library) preloaded in front of ``path``, it must also
    have sent the one-row and one-column products to sgemv.
    """
    if not os.path.isfile(path) or (forwarder is not None and not os.path.isfile(forwarder)):
        return False
    libs = [path] if forwarder is None else [forwarder, path]
    env = dict(os.environ, LD_PRELOAD=":".join(libs), **{ACTIVE_ENV: path})
    real = [os.path.realpath(lib) for lib in libs]
    try:
        result = subprocess.run(
            [sys.executable, "-c", _PROBE, *real[::-1]],
            env=env,
            capture_output=True,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def select(
    setting: str,
    *,
    find: Callable[[], list[str]] | None = None,
    check: Callable[[str], bool] | None = None,
) -> str | None:
    """The library to preload for ``setting`` ("auto", "off" or a path), or None for none.

    Raises:
        ValueError: If ``setting`` names a file that does not exist or fails the probe.
    """
    find = find or candidates  # looked up at call time, so tests can stand in for them
    check = check or probe
    if setting == "off" or platform.system() != "Linux":
        return None
    if setting == "auto":
        return next((path for path in find() if check(path)), None)
    if not os.path.isfile(setting):
        raise ValueError(f"--blas {setting}: no such file")
    if not check(setting):
        raise ValueError(f"--blas {setting}: MLX does not run correctly with this library")
    return setting


def ensure_blas(
    setting: str = "auto",
    *,
    gemv: bool = True,
    argv: Sequence[str] | None = None,
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr),
) -> str:
    """Re-execute this process with an optimized BLAS preloaded, if one is chosen and not loaded.

    With ``gemv``, the gemv forwarder (``gemv_forward``) is built, probed and preloaded in front
    of the chosen library; if it cannot be, a one-line notice says why and the BLAS runs alone.
    Call it first thing in an entry point, before MLX is imported. Returns a description of the
    BLAS in use when it does not re-execute ("bundled" or the preloaded paths).

    Raises:
        ValueError: For an explicit path that is missing or fails the probe.
    """
    active = os.environ.get(ACTIVE_ENV)
    if active:
        return active
    chosen = select(setting)
    if chosen is None:
        if setting == "auto" and platform.system() == "Linux":
            log(
                "blas: no optimized BLAS found; MLX uses the wheel's reference BLAS "
                "(install libopenblas0-pthread for 5-50x faster matmuls)"
            )
        return "bundled"
    libs = [chosen]
    if gemv:
        from veloxquant_mlx import gemv_forward

        try:
            forwarder = str(gemv_forward.build())
        except (OSError, RuntimeError) as exc:
            log(f"blas: gemv forwarder not built ({exc}); one-row products use sgemm")
        else:
            if probe(chosen, forwarder=forwarder):
                libs.insert(0, forwarder)
            else:
                log(f"blas: gemv forwarder {forwarder} failed its probe; not used")
    env = dict(os.environ)
    preload = env.get("LD_PRELOAD", "")
    for lib in reversed(libs):
        preload = _preload_value(lib, preload)
    env["LD_PRELOAD"] = preload
    env[ACTIVE_ENV] = " + ".join(reversed(libs))
    args = list(argv) if argv is not None else [sys.executable, *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, args, env)
    raise AssertionError("unreachable: execve returned")


def blas_in_use() -> str:
    """The BLAS libraries mapped into this process (the bundled one included), for reports."""
    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split()[-1] for line in fh if "blas" in line.lower() and "/" in line}
    except OSError:
        return "Accelerate" if platform.system() == "Darwin" else "unknown"
    names = sorted({p.rsplit("/", 1)[-1] for p in paths if "scipy_openblas" not in p})
    return ", ".join(names) or "none loaded"


def _preload_value(path: str, existing: str) -> str:
    parts = [p for p in existing.split(":") if p and p != path]
    return ":".join([path, *parts])


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m veloxquant_mlx.blas [auto|off|PATH]``: print the library it would preload."""
    args = list(sys.argv[1:] if argv is None else argv)
    chosen = select(args[0] if args else "auto")
    print(chosen or "bundled")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
