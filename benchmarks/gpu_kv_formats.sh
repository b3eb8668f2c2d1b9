#!/usr/bin/env bash
# Quantized KV on a GPU in one device call: the kernels alone per step (benchmarks.attention_bench
# --formats: tile and plain against bf16's attention routes), then the decode step taken
# apart per format and route (int8 and int4 fused, each also with the kernels' plain
# warp-per-position step, int8 fused with a 16-token
# window; row 0's tokens against bf16's; and 4 rows of 6,000 tokens, where the kernel splits
# each row over several blocks), then
# serving at 32 and 128 clients, bf16 against fused int8 and fused int4, then a budget that
# holds about half of 128 clients' contexts in bf16. With MLX_ROUTE=1 the step benchmark also
# takes int8 through mlx_lm's quantized attention (a server refuses that route where it
# computes wrong, as on MLX 0.32.4's CUDA backend). Writes under OUT_DIR; prints the tables and
# each level's line.
#
#   benchmarks/gpu_kv_formats.sh OUT_DIR [SHAPE]    (default 8b; under 10 minutes: the budget
#                                                   run only if time is left)
#
# On the lent GPU (../shared/gpu/README.md): after staging, in the call that sources
# .gpu2/env.sh. Every server is stopped by pid (benchmarks.serving's context managers).
set -uo pipefail
out=$1 shape=${2:-8b}
mkdir -p "$out" bench-work
. "$(dirname "$0")/serve_lib.sh"
model=$(gpu_model "$shape")
ln -sfn "$model" "bench-work/model-$shape"           # step_anatomy's name for it
ln -sfn "$model" "bench-work/model-$shape-tokvocab"  # benchmarks.serving's
kv=$([ "$shape" = 8b ] && echo 16384 || echo 8192)
t0=$(date +%s)
timeout 120 python3 -m benchmarks.attention_bench --shape "$shape" --rows 32,128 --width 384 \
  --no-model --formats int8,int4 > "$out/kernels.txt" 2>&1
timeout 60 python3 -m benchmarks.attention_bench --shape "$shape" --rows 4 --width 6000 \
  --no-model --formats int8,int4 >> "$out/kernels.txt" 2>&1
grep '^{' "$out/kernels.txt"
formats=auto,int8+fused,int8+plain,int4+fused,int4+plain,int8+fused+w16
[ "${MLX_ROUTE:-0}" = 1 ] && formats=auto,int8,int8+fused,int8+plain,int4+fused,int8+fused+w16
timeout 300 python3 -m benchmarks.step_anatomy --shape "$shape" --rows 32,128 \
  --formats "$formats" --traffic greedy --steps 15 > "$out/anatomy.txt" 2>&1
grep '^|' "$out/anatomy.txt"
# few rows over a long context (an agent's): the kernel splits each row's positions
timeout 150 python3 -m benchmarks.step_anatomy --shape "$shape" --rows 4 --context 6000 \
  --formats auto,int8+fused,int8+plain,int4+fused --traffic greedy --steps 6 > "$out/anatomy-long.txt" 2>&1
grep '^|' "$out/anatomy-long.txt"
variants=(--variant="--kv-format int8 --quantized-attention fused"
          --variant="--kv-format int4 --quantized-attention fused")
left=$(( 560 - ($(date +%s) - t0) ))
timeout "$left" python3 -m benchmarks.serving --shape "$shape" --concurrency 32,128 --per-client 3 \
  --tokenizer-vocab --layouts dense --peers none --kv-cache-mb "$kv" --peak-gbs 4800 \
  "${variants[@]}" --out "$out/serving" > "$out/serving.txt" 2>&1
grep -E "^ours|c=[0-9]+:" "$out/serving.txt" | cut -c1-140
left=$(( 570 - ($(date +%s) - t0) ))
if [ "$left" -gt 150 ]; then
  timeout "$left" python3 -m benchmarks.serving --shape "$shape" --concurrency 128 \
    --per-client 3 --tokenizer-vocab --layouts dense --peers none \
    --kv-cache-mb $(( kv * 3300 / 16384 )) --peak-gbs 4800 \
    --variant="--kv-format int4 --quantized-attention fused" --out "$out/budget" \
    > "$out/budget.txt" 2>&1
  grep -E "^ours|c=[0-9]+:" "$out/budget.txt" | cut -c1-140
fi
