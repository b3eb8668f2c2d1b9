#!/usr/bin/env bash
# The agent benchmark against mlx_lm.server on a GPU, the BENCHMARKS.md table's commands in one
# device call: for each SESSIONS count, ours with the defaults (every token sent as made, as
# mlx_lm.server does) then mlx_lm.server, on one random-weight shape. Writes OUT_DIR/agent-S.md
# (the table) and agent-S.txt (the run's output) per count; prints the tables.
#
#   benchmarks/gpu_agent_peers.sh OUT_DIR SHAPE SESSIONS[:TURNS] [SESSIONS[:TURNS] ...]
#   benchmarks/gpu_agent_peers.sh "$OUT/agent" 1b 4:8 16:4
#
# LIMIT (environment, default 280) caps each count's run in seconds. On the lent GPU
# (../shared/gpu/README.md): after staging, in the call that sources .gpu2/env.sh. Every
# server is stopped by pid (the benchmark's own context managers).
set -uo pipefail
dest=$1 shape=$2
shift 2
mkdir -p "$dest"
. "$(dirname "$0")/serve_lib.sh"
model=$(gpu_model "$shape")
kv=$([ "$shape" = 8b ] && echo 16384 || echo 8192)
for spec in "$@"; do
  sessions=${spec%%:*} turns=6
  [[ $spec == *:* ]] && turns=${spec#*:}
  timeout "${LIMIT:-280}" python3 -m benchmarks.agent_bench --model-path "$model" \
    --sessions "$sessions" --turns "$turns" --system-words 2000 --turn-words 50-400 \
    --max-tokens 64 --kv-cache-mb "$kv" --ours-args "--blas off --stream-interval-ms 0" \
    --peers mlx_lm --out "$dest/agent-$sessions.md" > "$dest/agent-$sessions.txt" 2>&1 \
    || echo "agent_bench: exit $?" >> "$dest/agent-$sessions.txt"
  echo "## $shape, $sessions sessions, $turns turns"
  cat "$dest/agent-$sessions.md" 2>/dev/null || tail -20 "$dest/agent-$sessions.txt"
done
