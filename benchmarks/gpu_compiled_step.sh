#!/usr/bin/env bash
# The compiled decode step (--compiled-step) against eager steps on a GPU: the step taken apart
# (benchmarks.step_anatomy, each shape's dense step eager and compiled, greedy and sampled, at
# 1, 32 and 128 rows), then the serving benchmark at 1, 32 and 128 clients with each (the
# first server eager, CUDA's default, the variant compiled; greedy and sampled traffic; 1B
# shape, the shipped tokenizer's vocabulary). Writes under OUT_DIR; prints the tables and any
# traceback.
#
#   benchmarks/gpu_compiled_step.sh OUT_DIR [SHAPES]    (default "1b 8b"; ~4 min a shape for
#                                                        the steps, ~4 min for the serving)
#
# On the lent GPU (../shared/gpu/README.md): after staging, in the call that sources
# .gpu2/env.sh. Every server is stopped by pid (benchmarks.serving's context managers).
set -euo pipefail
out=$1 shapes=${2:-1b 8b}
mkdir -p "$out"
. "$(dirname "$0")/serve_lib.sh"
for shape in $shapes; do
  model=$(gpu_model "$shape")
  timeout 300 python3 -m benchmarks.step_anatomy --shape "$shape" --rows 1,32,128 --steps 15 \
    --formats auto,auto+compiled --traffic greedy,sampled --work "$(dirname "$model")" \
    > "$out/steps-$shape.txt" 2>&1 || echo "step_anatomy: exit $?" >> "$out/steps-$shape.txt"
  grep -E "^\||exit|Error" "$out/steps-$shape.txt" || true
done
timeout 400 python3 -m benchmarks.serving --shape 1b --tokenizer-vocab --concurrency 1,32,128 \
  --per-level 16 --per-client 4 --max-tokens 128 --peers none --layouts dense \
  --sampling greedy,sampled --kv-cache-mb 8192 --variant=--compiled-step=on \
  --out "$out/serving" > "$out/serving.txt" 2>&1 || echo "benchmarks.serving: exit $?" >> "$out/serving.txt"
grep -E "^ours|c=[0-9]+:|exit|^\|" "$out/serving.txt" | cut -c1-160
grep -l "Traceback" "$out/serving"/*.log 2>/dev/null | while read -r f; do
  echo "== $f"; grep -B2 -A25 "Traceback" "$f" | head -60
done
