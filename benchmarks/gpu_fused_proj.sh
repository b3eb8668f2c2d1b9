#!/usr/bin/env bash
# Fused projections (--fused-projections: q/k/v as one matmul, gate/up as another) against
# mlx_lm's five a layer on a GPU: the decode step taken apart (benchmarks.step_anatomy, each
# shape's dense step with and without, greedy and sampled, at 1, 32 and 128 rows), then the
# serving benchmark on the 8B shape at 1, 32 and 128 clients (the first server the default,
# fused; the variant --fused-projections=off; greedy and sampled), with the memory roofline
# (the device's peak read from nvidia-smi's name: H200 4.8 TB/s, H100 3.35). Writes under
# OUT_DIR; prints the tables and any traceback.
#
#   benchmarks/gpu_fused_proj.sh OUT_DIR [SHAPES] [SERVE_SHAPE]   (defaults "1b 8b", 8b; "" and
#                                                  none skip the steps and the serving;
#                                                  ~2 min a shape for the steps, ~5 for serving)
#
# On the lent GPU (../shared/gpu/README.md): after staging, in the call that sources
# .gpu2/env.sh. Every server is stopped by pid (benchmarks.serving's context managers).
set -euo pipefail
out=$1 shapes=${2-1b 8b} serve=${3:-8b}
mkdir -p "$out"
. "$(dirname "$0")/serve_lib.sh"
peak=4800
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H100 && peak=3350
for shape in $shapes; do
  model=$(gpu_model "$shape")
  timeout 300 python3 -m benchmarks.step_anatomy --shape "$shape" --rows 1,32,128 --steps 15 \
    --formats auto,auto+proj,auto,auto+proj --traffic greedy,sampled \
    --work "$(dirname "$model")" > "$out/steps-$shape.txt" 2>&1 \
    || echo "step_anatomy: exit $?" >> "$out/steps-$shape.txt"
  grep -E "^\||exit|Error" "$out/steps-$shape.txt" || true
done
[ "$serve" = none ] && exit 0
mb=8192; [ "$serve" = 8b ] && mb=16384
timeout 420 python3 -m benchmarks.serving --shape "$serve" --tokenizer-vocab \
  --concurrency 1,32,128 --per-level 16 --per-client 4 --max-tokens 128 --peers none \
  --layouts dense --sampling greedy,sampled --kv-cache-mb "$mb" --peak-gbs "$peak" \
  --variant=--fused-projections=off --out "$out/serving" > "$out/serving.txt" 2>&1 \
  || echo "benchmarks.serving: exit $?" >> "$out/serving.txt"
grep -E "^ours|c=[0-9]+:|exit|^\||roofline" "$out/serving.txt" | cut -c1-180
grep -l "Traceback" "$out/serving"/*.log 2>/dev/null | while read -r f; do
  echo "== $f"; grep -B2 -A25 "Traceback" "$f" | head -60
done
