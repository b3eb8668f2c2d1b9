#!/usr/bin/env bash
# One device call that says where an agent workload's inter-token p99 and a restart's first
# turn go on a GPU: the agent benchmark (ours only, --log-level debug) with its slow steps
# summed by phase, and the restart benchmark with its servers' logs, with the warm-up's long
# conversation (--warm-up-context 8192) and without it (the default). Writes under OUT_DIR.
#
#   benchmarks/gpu_agent_trace.sh OUT_DIR [SHAPE]    (SHAPE: 8b or 1b; default 8b)
#
# On the lent GPU (../shared/gpu/README.md): after staging, in the call that sources
# .gpu2/env.sh. About 6-8 minutes for the 8B shape (model writing ~1 min, each 8B server's
# start ~30-60 s). Every server is stopped by pid (the benchmarks' own context managers).
set -euo pipefail
out=$1 shape=${2:-8b}
mkdir -p "$out"
. "$(dirname "$0")/serve_lib.sh"
model=$(gpu_model "$shape") model_1b=$(gpu_model 1b)
kv=$([ "$shape" = 8b ] && echo 16384 || echo 8192)
timeout 280 python3 -m benchmarks.agent_bench --model-path "$model" --sessions 4 \
  --turns 6 --system-words 2000 --turn-words 50-400 --max-tokens 64 --kv-cache-mb "$kv" \
  --peers none --ours-args "--blas off --log-level debug" --logs "$out/agent-logs" \
  --out "$out/agent.md" > "$out/agent.txt" 2>&1 || echo "agent_bench: exit $?" >> "$out/agent.txt"
python3 -m benchmarks.slow_steps "$out"/agent-logs/ours-*.log > "$out/slow-steps.md" 2>&1 || true
# The restart with the defaults and with a long conversation in the warm-up
for ctx in 0 8192; do
  extra=$([ "$ctx" = 0 ] || echo " --warm-up-context $ctx")
  timeout 200 python3 -m benchmarks.restart_bench --model-path "$model_1b" \
    --context-words 1800 --new-words 60 --repeats 2 --logs "$out/restart-logs-$ctx" \
    --ours-args "--blas off --kv-cache-mb 8192 --log-level debug$extra" \
    > "$out/restart-$ctx.txt" 2>&1 || echo "restart_bench: exit $?" >> "$out/restart-$ctx.txt"
done
cat "$out/agent.md" "$out/slow-steps.md" 2>/dev/null; tail -n 4 "$out"/restart-*.txt
