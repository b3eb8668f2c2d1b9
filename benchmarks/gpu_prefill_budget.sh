#!/usr/bin/env bash
# One device call that chooses the GPU's --prefill-budget by measurement: the agent benchmark
# (ours only, --log-level debug) at each budget in turn on one machine, with each run's slow
# steps summed by phase. Writes under OUT_DIR.
#
#   benchmarks/gpu_prefill_budget.sh OUT_DIR [SHAPE] [BUDGETS] [TURNS] [SESSIONS] [SERVER_ARGS]
#     (SHAPE: 8b or 1b, default 8b; BUDGETS: default "512 256"; TURNS: default 4; SESSIONS:
#      default 4, or a list "4,16"; SERVER_ARGS: more flags for every server, e.g.
#      "--stream-interval-ms 0")
#
# On the lent GPU (../shared/gpu/README.md): after staging, in the call that sources
# .gpu2/env.sh. About 2-3 minutes a budget for the 8B shape after the model is written.
# Every server is stopped by pid (the benchmark's own context manager).
set -euo pipefail
out=$1 shape=${2:-8b} budgets=${3:-512 256} turns=${4:-4} sessions=${5:-4} more=${6:-}
mkdir -p "$out"
models=${TMPDIR:-/tmp}/vq-models
python3 -c "from pathlib import Path; from benchmarks.serving import write_model
p = Path('$models') / 'model-$shape'
if not (p / 'config.json').exists():
    write_model(p, '$shape', 'bfloat16', True)"
kv=$([ "$shape" = 8b ] && echo 16384 || echo 8192)
for b in $budgets; do
  timeout 200 python3 -m benchmarks.agent_bench --model-path "$models/model-$shape" \
    --sessions "$sessions" --turns "$turns" --system-words 2000 --turn-words 50-400 --max-tokens 64 \
    --kv-cache-mb "$kv" --peers none --logs "$out/logs-$b" --out "$out/agent-$b.md" \
    --ours-args "--blas off --log-level debug --prefill-budget $b $more" \
    > "$out/agent-$b.txt" 2>&1 || echo "agent_bench: exit $?" >> "$out/agent-$b.txt"
  python3 -m benchmarks.slow_steps "$out"/logs-"$b"/ours-*.log > "$out/slow-steps-$b.md" 2>&1 || true
done
for b in $budgets; do echo "## --prefill-budget $b"; cat "$out/agent-$b.md" "$out/slow-steps-$b.md" 2>/dev/null; done
