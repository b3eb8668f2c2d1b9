#!/usr/bin/env bash
# One device call that compares server settings on the agent benchmark: ours only, at
# --log-level debug, each setting in turn, ROUNDS times (alternating, so machine drift falls on
# all), each run's slow steps summed by phase. Writes one report, OUT_DIR/ab.md (the device
# tool brings back at most 8 files); the runs' logs stay in WORK (default a temporary folder).
#
#   benchmarks/gpu_agent_ab.sh OUT_DIR SHAPE TURNS ROUNDS SETTING [SETTING ...]
#
# A SETTING is server flags, optionally after environment assignments (NAME=VALUE) for the
# server's process; "" is the defaults. SESSIONS (environment, default 4) is the sessions.
#   benchmarks/gpu_agent_ab.sh "$OUT/ab" 1b 6 2 "" "--prefill-stream on"
#
# On the lent GPU (../shared/gpu/README.md): after staging, in the call that sources
# .gpu2/env.sh. About 40 s a run for the 1B shape, 1.5-2 minutes for the 8B one (its start).
# Every server is stopped by pid (the benchmark's own context manager).
set -euo pipefail
dest=$1 shape=$2 turns=$3 rounds=$4
shift 4
mkdir -p "$dest"
report=$dest/ab.md
out=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/vq-ab.XXXXXX")}
mkdir -p "$out"
. "$(dirname "$0")/serve_lib.sh"
model=$(gpu_model "$shape")
kv=$([ "$shape" = 8b ] && echo 16384 || echo 8192)
for r in $(seq 1 "$rounds"); do
  i=0
  for setting in "$@"; do
    i=$((i + 1))
    envs=() flags=()
    for word in $setting; do
      if [[ $word =~ ^[A-Z_]+= ]]; then envs+=("$word"); else flags+=("$word"); fi
    done
    name="$i-$r"
    echo "$name: $setting" >> "$out/settings.txt"
    timeout 240 env "${envs[@]}" python3 -m benchmarks.agent_bench \
      --model-path "$model" --sessions "${SESSIONS:-4}" --turns "$turns" \
      --system-words 2000 --turn-words 50-400 --max-tokens 64 --kv-cache-mb "$kv" \
      --peers none --logs "$out/logs-$name" --out "$out/agent-$name.md" \
      --ours-args "--blas off --log-level debug ${flags[*]}" \
      > "$out/agent-$name.txt" 2>&1 || echo "agent_bench: exit $?" >> "$out/agent-$name.txt"
    python3 -m benchmarks.slow_steps "$out"/logs-"$name"/ours-*.log > "$out/slow-$name.md" 2>&1 \
      || true
  done
done
{
  cat "$out/settings.txt"
  for f in "$out"/agent-*.md; do echo "## $(basename "$f" .md)"; cat "$f"; done
  for f in "$out"/slow-*.md; do echo "## slow steps, $(basename "$f" .md)"; cat "$f"; done
  for f in "$out"/agent-*.txt; do grep -h "agent_bench: exit\|Error" "$f" | sed "s|^|$(basename "$f"): |" || true; done
} > "$report" 2>&1
cat "$report"
