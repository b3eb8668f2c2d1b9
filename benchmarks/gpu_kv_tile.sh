#!/usr/bin/env bash
# The quantized kernels' tile step against the warp-per-position one, in one device call,
# most telling first: the kernels alone (benchmarks.attention_bench --formats: every layer's
# attention at 32 and 128 rows of 384 tokens, and 4 rows of 6,000 where they split), the
# decode step taken apart (int8 / int4 with each step against bf16, row 0's tokens against
# bf16's), then serving bf16 against int8 (tile) at 32 and 128 clients while time is left.
# Writes under OUT_DIR; prints each part's lines.
#
#   benchmarks/gpu_kv_tile.sh OUT_DIR [SHAPE]    (default 8b; under 8 minutes)
#
# On the lent GPU (../shared/gpu/README.md): after staging, in the call that sources
# .gpu2/env.sh. Every server is stopped by pid (benchmarks.serving's context managers).
set -uo pipefail
out=$1 shape=${2:-8b}
mkdir -p "$out" bench-work
. "$(dirname "$0")/serve_lib.sh"
t0=$(date +%s)
model=$(gpu_model "$shape")
ln -sfn "$model" "bench-work/model-$shape"           # step_anatomy's name for it
ln -sfn "$model" "bench-work/model-$shape-tokvocab"  # benchmarks.serving's
echo "model ready after $(( $(date +%s) - t0 )) s"
timeout 100 python3 -m benchmarks.attention_bench --shape "$shape" --rows 32,128 --width 384 \
  --no-model --formats int8,int4 > "$out/kernels.txt" 2>&1
timeout 60 python3 -m benchmarks.attention_bench --shape "$shape" --rows 4 --width 6000 \
  --no-model --formats int8 >> "$out/kernels.txt" 2>&1
grep -E '^\{|Error' "$out/kernels.txt"
timeout 240 python3 -m benchmarks.step_anatomy --shape "$shape" --rows 32,128 \
  --formats auto,int8+fused,int8+plain,int4+fused,int4+plain --traffic greedy --steps 12 \
  > "$out/anatomy.txt" 2>&1
grep -E '^\||Error' "$out/anatomy.txt"
left=$(( 480 - ($(date +%s) - t0) ))
echo "serving with $left s left"
if [ "$left" -gt 150 ]; then
  timeout "$left" python3 -m benchmarks.serving --shape "$shape" --concurrency 32,128 \
    --per-client 2 --tokenizer-vocab --layouts dense --peers none --kv-cache-mb 16384 \
    --peak-gbs 4800 --variant="--kv-format int8" --out "$out/serving" > "$out/serving.txt" 2>&1
  grep -E "^ours|c=[0-9]+:" "$out/serving.txt" | cut -c1-160
fi
