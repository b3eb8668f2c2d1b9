#!/usr/bin/env bash
# The prefill attention routes on a GPU in one device call: a cached turn's chunk taken apart
# (benchmarks.chunk_bench: the routes' attention alone, cold and warm, then each route's whole
# forward), then the agent benchmark with the default route (matmul: grouped products, MLX's
# softmax in one pass) against --prefill-attention buckets (cuDNN over bucketed shapes, its
# graphs built by the warm-up), ours only, each server's slow steps by phase. Writes under
# OUT_DIR (routes.txt, forward.txt, ab/ab.md); prints the tables.
#
#   benchmarks/gpu_prefill_routes.sh OUT_DIR [SHAPE] [PEAK_GBS]   (default 8b, 4800; ~8 min)
#
# On the lent GPU (../shared/gpu/README.md): after staging, in the call that sources
# .gpu2/env.sh. Every server is stopped by pid (the benchmarks' own context managers).
set -uo pipefail
out=$1 shape=${2:-8b} peak=${3:-4800}
mkdir -p "$out" bench-work
. "$(dirname "$0")/serve_lib.sh"
model=$(gpu_model "$shape")
ln -sfn "$model" "bench-work/model-$shape"  # chunk_bench's name for it
timeout 150 python3 -m benchmarks.chunk_bench --shape "$shape" --routes \
  --context 2000,6000,16000,32000 --chunk 64,512 --repeats 3 > "$out/routes.txt" 2>&1
grep '^|' "$out/routes.txt"
timeout 100 python3 -m benchmarks.chunk_bench --shape "$shape" --context 6000,16000 \
  --chunk 64,128,512 --repeats 3 --peak-gbs "$peak" > "$out/forward.txt" 2>&1
grep '^|' "$out/forward.txt"
timeout 330 bash "$(dirname "$0")/gpu_agent_ab.sh" "$out/ab" "$shape" 6 1 \
  "--stream-interval-ms 0" "--stream-interval-ms 0 --prefill-attention buckets" \
  > "$out/ab.txt" 2>&1
sed -n '1,80p' "$out/ab/ab.md" 2>/dev/null || tail -5 "$out/ab.txt"
