#!/usr/bin/env bash
# Sampled traffic against greedy with each top_p cut, on a GPU, the servers' logs kept: per
# round, one benchmarks.serving run whose first server takes the sort (the default) and whose
# variant takes the histogram cut (--sampling-cut histogram), each loaded with greedy, sampled,
# greedy, sampled at 1, 32 and 128 clients (1B shape, the shipped tokenizer's vocabulary).
# Writes under OUT_DIR; prints each level's line and any traceback in a server's log.
#
#   benchmarks/gpu_sampling_ab.sh OUT_DIR [ROUNDS]    (default 1; ~5 minutes a round)
#
# On the lent GPU (../shared/gpu/README.md): after staging, in the call that sources
# .gpu2/env.sh. Every server is stopped by pid (benchmarks.serving's context managers).
set -euo pipefail
out=$1 rounds=${2:-1}
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  timeout 560 python3 -m benchmarks.serving --shape 1b --tokenizer-vocab --concurrency 1,32,128 \
    --per-level 16 --per-client 4 --max-tokens 128 --peers none --layouts dense \
    --sampling greedy,sampled,greedy,sampled --kv-cache-mb 8192 \
    --variant=--sampling-cut=histogram --out "$out/round-$r" > "$out/round-$r.txt" 2>&1 \
    || echo "benchmarks.serving: exit $?" >> "$out/round-$r.txt"
  grep -E "^ours|c=[0-9]+:|exit" "$out/round-$r.txt" | cut -c1-120
  grep -l "Traceback" "$out/round-$r"/*.log 2>/dev/null | while read -r f; do
    echo "== $f"; grep -B2 -A25 "Traceback" "$f" | head -60
  done
done
