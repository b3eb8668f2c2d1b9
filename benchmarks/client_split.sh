#!/usr/bin/env bash
# Is the load client the limit? The same closed-loop load on one server from one loadtest
# process, then split over 2 and 4 processes (the same total concurrency and requests, run at
# once): if the summed tok/s grows, one Python client could not keep up. Loopback only; every
# process it starts is stopped by pid.
#
#   benchmarks/client_split.sh MODEL_DIR OUT_DIR CONCURRENCY REQUESTS PROMPT_WORDS MAX_TOKENS
set -euo pipefail
model=$1 out=$2 c=$3 n=$4 words=$5 tokens=$6
mkdir -p "$out"
. "$(dirname "$0")/serve_lib.sh"
trap 'kill ${srv:-} 2>/dev/null; wait 2>/dev/null || true' EXIT
start_server "$model" "$out/server.log"
load() { python3 -m loadtest --url "http://127.0.0.1:$port" --prompt-words "$words-$words" \
  --max-tokens "$tokens" --no-leak-check --scrape-interval 1000 "$@"; }
load --concurrency 8 --requests 32 > /dev/null
for k in ${SPLITS:-1 2 4}; do
  pids=""
  start=$(date +%s.%N)
  for i in $(seq 1 $k); do
    load --concurrency $((c / k)) --requests $((n / k)) --seed "$i" --json "$out/split$k-$i.json" \
      > "$out/split$k-$i.txt" 2>&1 &
    pids="$pids $!"
  done
  wait $pids
  end=$(date +%s.%N)
  python3 - "$out" "$k" "$start" "$end" <<'PY'
import json, sys
out, k, start, end = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
runs = [json.load(open(f"{out}/split{k}-{i}.json"))[-1] for i in range(1, k + 1)]
rate = sum(r["output_tokens_per_s"] for r in runs)
tokens = sum(r.get("output_tokens", 0) for r in runs)
print(f"{k} client process(es): summed {rate:.0f} tok/s; {tokens} tokens over {end - start:.1f} s wall"
      f" = {tokens / (end - start):.0f} tok/s; errors {[r.get('errors_by_status') for r in runs]}")
PY
done
