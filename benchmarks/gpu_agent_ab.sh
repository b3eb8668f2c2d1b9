#!/usr/bin/env bash
# One device call that compares two server settings on the agent benchmark: ours only, at
# --log-level debug, A then B, ROUNDS times (alternating, so machine drift falls on both), each
# run's slow steps summed by phase. Writes under OUT_DIR.
#
#   benchmarks/gpu_agent_ab.sh OUT_DIR SHAPE TURNS ROUNDS "A_ARGS" "B_ARGS" [SESSIONS]
#     e.g. benchmarks/gpu_agent_ab.sh "$OUT/ab" 1b 6 2 "--prefill-stream off" "--prefill-stream on"
#
# On the lent GPU (../shared/gpu/README.md): after staging, in the call that sources
# .gpu2/env.sh. About 40 s a run for the 1B shape, 1.5-2 minutes for the 8B one (its start).
# Every server is stopped by pid (the benchmark's own context manager).
set -euo pipefail
out=$1 shape=$2 turns=$3 rounds=$4 a=$5 b=$6 sessions=${7:-4}
mkdir -p "$out"
models=${TMPDIR:-/tmp}/vq-models
python3 -c "from pathlib import Path; from benchmarks.serving import write_model
p = Path('$models') / 'model-$shape'
if not (p / 'config.json').exists():
    write_model(p, '$shape', 'bfloat16', True)"
kv=$([ "$shape" = 8b ] && echo 16384 || echo 8192)
for r in $(seq 1 "$rounds"); do
  for side in A B; do
    flags=$([ "$side" = A ] && echo "$a" || echo "$b")
    name="$side-$r"
    timeout 240 python3 -m benchmarks.agent_bench --model-path "$models/model-$shape" \
      --sessions "$sessions" --turns "$turns" --system-words 2000 --turn-words 50-400 \
      --max-tokens 64 --kv-cache-mb "$kv" --peers none --logs "$out/logs-$name" \
      --out "$out/agent-$name.md" --ours-args "--blas off --log-level debug $flags" \
      > "$out/agent-$name.txt" 2>&1 || echo "agent_bench: exit $?" >> "$out/agent-$name.txt"
    python3 -m benchmarks.slow_steps "$out"/logs-"$name"/ours-*.log > "$out/slow-$name.md" 2>&1 \
      || true
  done
done
echo "A: $a"; echo "B: $b"
for f in "$out"/agent-*.md; do echo "## $(basename "$f" .md)"; grep "| ours" "$f" || true; done
for f in "$out"/slow-*.md; do echo "## $(basename "$f" .md)"; cat "$f"; done
