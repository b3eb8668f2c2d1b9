#!/usr/bin/env bash
# Quantized KV at a fixed KV budget on a GPU, in one device call: first how many requests a
# budget for 8 in bf16 runs at once per format (benchmarks.kv_capacity: 8, 15 and 24 sent at
# once, bf16, int8 and int4), then 128 clients against a budget that holds N of their
# contexts in the model's type, bf16 then int8 then int4 (fused), for each N given (the
# pool's bytes for N contexts of 256 + 128 tokens, 8B: 16,384 MiB hold ~320). A larger batch
# the compressed pool admits pays where the batch is what bounds the step rate; at a large N
# the bf16 pool already runs most clients at once. Writes under OUT_DIR; prints the capacity
# table and each server's line.
#
#   benchmarks/gpu_kv_budget.sh OUT_DIR [SHAPE] [N...]   (default 8b, N = 16 32; ~8 minutes)
#
# On the lent GPU (../shared/gpu/README.md): after staging, in the call that sources
# .gpu2/env.sh. Every server is stopped by pid (benchmarks.serving's context managers).
set -uo pipefail
out=$1 shape=${2:-8b}
shift 2 2>/dev/null || shift $#
counts=("$@")
[ ${#counts[@]} -eq 0 ] && counts=(16 32)
mkdir -p "$out" bench-work
. "$(dirname "$0")/serve_lib.sh"
model=$(gpu_model "$shape")
ln -sfn "$model" "bench-work/model-$shape-tokvocab"  # benchmarks.serving's name for it
full=$([ "$shape" = 8b ] && echo 16384 || echo 8192)  # MiB for ~320 contexts
t0=$(date +%s)
timeout 200 python3 -m benchmarks.kv_capacity --model-path "$model" --n 8 \
  --formats auto,int8,int4 --prompt-words 300 --max-tokens 64 --server-args "--blas off" \
  --out "$out/capacity" > "$out/capacity.txt" 2>&1
grep '^|' "$out/capacity.txt"
for n in "${counts[@]}"; do
  left=$(( 580 - ($(date +%s) - t0) ))
  [ "$left" -lt 60 ] && { echo "no time left for N=$n"; break; }
  timeout "$left" python3 -m benchmarks.serving --shape "$shape" --concurrency 128 \
    --per-client 2 --tokenizer-vocab --layouts dense --peers none \
    --kv-cache-mb $(( full * n / 320 )) --peak-gbs 4800 \
    --variant="--kv-format int8 --quantized-attention fused" \
    --variant="--kv-format int4 --quantized-attention fused" --out "$out/budget-$n" \
    > "$out/budget-$n.txt" 2>&1
  echo "N=$n ($(( full * n / 320 )) MiB)"
  grep -E "^ours|c=[0-9]+:" "$out/budget-$n.txt" | cut -c1-160
done
