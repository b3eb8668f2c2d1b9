#!/usr/bin/env bash
# A restart's first turn on a GPU, and the disk tier's read: the page read alone
# (benchmarks.disk_read_bench at the shape's geometry), then the restart benchmark with its
# three controls (the restarted server preloads its conversations before it is ready; one that
# reads the pages on the hit; the same server with the conversation in memory). Writes under
# OUT_DIR.
#
#   benchmarks/gpu_restart.sh OUT_DIR SHAPE [REPEATS]    (SHAPE: 8b or 1b)
#
# On the lent GPU (../shared/gpu/README.md): after staging, in the call that sources
# .gpu2/env.sh. The 1B shape takes ~3-4 minutes with 2 repeats, the 8B one ~5-7 with 1
# (five servers a repeat, each 8B start ~30-60 s). Every server is stopped by pid (the
# benchmarks' own context managers).
set -euo pipefail
out=$1 shape=$2 repeats=${3:-1}
mkdir -p "$out"
. "$(dirname "$0")/serve_lib.sh"
model=$(gpu_model "$shape")
geometry=$([ "$shape" = 8b ] && echo "" || echo "--head-dim 64 --layers 16")
# shellcheck disable=SC2086
python3 -m benchmarks.disk_read_bench --pages 395 --repeats 3 $geometry > "$out/disk-read-$shape.md" 2>&1 \
  || echo "disk_read_bench: exit $?" >> "$out/disk-read-$shape.md"
kv=$([ "$shape" = 8b ] && echo 16384 || echo 8192)
timeout 480 python3 -m benchmarks.restart_bench --model-path "$model" \
  --context-words 1800 --new-words 60 --repeats "$repeats" --in-memory --on-hit \
  --logs "$out/restart-logs-$shape" --ours-args "--blas off --kv-cache-mb $kv --log-level debug" \
  > "$out/restart-$shape.txt" 2>&1 || echo "restart_bench: exit $?" >> "$out/restart-$shape.txt"
cat "$out/disk-read-$shape.md"; tail -n 12 "$out/restart-$shape.txt"
grep -h "into memory\|read .* page(s)" "$out"/restart-logs-"$shape"/*.log | cut -c1-200 | head -20 || true
