"""Run a kernel written for ``mx.fast.cuda_kernel`` on this CPU: the kernel's source compiled by
the system's C++ compiler inside a harness where every CUDA thread of a block is a thread of
its own, warp shuffles and ``__syncthreads`` are barriers, and blocks run one after the other.
A test of the kernel's indexing and arithmetic (float32 only), not of its speed; what only a
GPU can say (the CUDA compiler, bf16 conversions) is the start check's there."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

_TYPES = {np.float32: "float", np.uint32: "uint32_t", np.int32: "int32_t"}

_PRELUDE = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
#define __shared__ static
using std::min;
struct float4 { float x, y, z, w; };
struct uint4 { uint32_t x, y, z, w; };
static inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
struct Dim3 { int x, y, z; };
thread_local Dim3 threadIdx, blockIdx;
static float exchange[1024];
static std::vector<std::unique_ptr<std::barrier<>>> warp_barrier;
static std::unique_ptr<std::barrier<>> block_barrier;
static float __shfl_xor_sync(unsigned, float v, int o) {
  const int t = threadIdx.x, w = t >> 5;
  exchange[t] = v;
  warp_barrier[w]->arrive_and_wait();
  const float r = exchange[(w << 5) | ((t & 31) ^ o)];
  warp_barrier[w]->arrive_and_wait();
  return r;
}
static float __shfl_sync(unsigned, float v, int src) {
  const int t = threadIdx.x, w = t >> 5;
  exchange[t] = v;
  warp_barrier[w]->arrive_and_wait();
  const float r = exchange[(w << 5) | (src & 31)];
  warp_barrier[w]->arrive_and_wait();
  return r;
}
#define __expf(x) std::exp(x)  // (glibc declares an __expf of its own)
static void __syncthreads() { block_barrier->arrive_and_wait(); }
inline float vq_float(float x) { return x; }
inline void vq_store(float* p, float v) { *p = v; }
template <class X> std::vector<X> load(const char* name) {
  std::vector<X> v; X x; FILE* f = std::fopen(name, "rb");
  while (std::fread(&x, sizeof(X), 1, f) == 1) v.push_back(x);
  std::fclose(f); return v;
}
"""


def compiler() -> str | None:
    """A C++20 compiler with ``std::barrier`` (g++ 11+ or clang++), or None."""
    return shutil.which("g++") or shutil.which("clang++")


def emulate(
    source: str,
    inputs: dict[str, np.ndarray],
    template: dict[str, int],
    outputs: dict[str, int],
    grid: tuple[int, int],
    threads: int,
    work: Path,
) -> dict[str, np.ndarray]:
    """``source``'s kernel over ``inputs`` (in ``cuda_kernel``'s order; float32, uint32 or
    int32), ``T`` as float and ``template``'s integers as constants, one block of ``threads``
    per ``(y, z)`` of ``grid``; returns its float32 ``outputs`` (name: values)."""
    params, args, loads = [], [], []
    for name, array in inputs.items():
        ctype = _TYPES[array.dtype.type]
        np.ascontiguousarray(array).tofile(work / f"{name}.bin")
        loads.append(f'auto {name}_v = load<{ctype}>("{work}/{name}.bin");')
        params.append(f"const {ctype}* {name}")
        args.append(f"{name}_v.data()")
        if re.search(rf"\b{name}_shape\b", source):
            shape = ", ".join(str(d) for d in array.shape)
            loads.append(f"static const int {name}_s[] = {{{shape}}};")
            params.append(f"const int* {name}_shape")
            args.append(f"{name}_s")
    constants = "".join(f"constexpr int {k} = {v};\n" for k, v in template.items())
    program = (
        _PRELUDE
        + "using T = float;\n"
        + constants
        + f"void kernel({', '.join(params + [f'float* {n}' for n in outputs])}) {{\n{source}\n}}\n"
        + "int main() {\n"
        + "\n".join(loads)
        + "".join(f"\nstd::vector<float> {n}({size}, 0.f);" for n, size in outputs.items())
        + "\n"
        + f"for (int w = 0; w < {threads // 32}; ++w) "
        + "warp_barrier.emplace_back(new std::barrier<>(32));\n"
        + f"block_barrier.reset(new std::barrier<>({threads}));\n"
        + f"for (int z = 0; z < {grid[1]}; ++z) for (int y = 0; y < {grid[0]}; ++y) {{\n"
        + "  std::vector<std::thread> ts;\n"
        + f"  for (int t = 0; t < {threads}; ++t) ts.emplace_back([&, t] {{\n"
        + "    threadIdx = {t, 0, 0}; blockIdx = {0, y, z};\n"
        + f"    kernel({', '.join(args + [f'{n}.data()' for n in outputs])}); }});\n"
        + "  for (auto& th : ts) th.join();\n}\n"
        + "".join(
            f'{{ FILE* f = std::fopen("{work}/{n}.out", "wb"); '
            f"std::fwrite({n}.data(), 4, {n}.size(), f); std::fclose(f); }}\n"
            for n in outputs
        )
        + "}\n"
    )
    (work / "kernel.cpp").write_text(program)
    cxx = compiler()
    assert cxx is not None
    build = [cxx, "-std=c++20", "-O1", "-pthread", "-w", "kernel.cpp", "-o", "kernel"]
    subprocess.run(build, cwd=work, check=True, capture_output=True, timeout=300)
    subprocess.run([str(work / "kernel")], cwd=work, check=True, timeout=300)
    return {n: np.fromfile(work / f"{n}.out", dtype=np.float32) for n in outputs}
