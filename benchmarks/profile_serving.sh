#!/usr/bin/env bash
# Where a serving run spends its time: py-spy (raw collapsed stacks, per thread) on our server,
# its engine process and the load client, plus every thread's CPU seconds over the same window,
# at one concurrency. Loopback only; every process it starts is stopped by pid.
#
#   benchmarks/profile_serving.sh MODEL_DIR OUT_DIR CONCURRENCY PROMPT_WORDS [server flags...]
# (LOAD_ARGS: more load client flags, e.g. "--temperature 0.7 --top-p 0.9"; REQUESTS: how many
# requests the profiled load sends, default 4 a client; it should outlast the 4 s wait and the
# 12 s profile)
# py-spy: here `pip install -e ".[profile]"`; on the lent GPU it comes with the wheels ($SITE).
set -euo pipefail
model=$1 out=$2 c=$3 words=$4; shift 4
mkdir -p "$out"
spy=${SITE:+$SITE/bin/}py-spy
. "$(dirname "$0")/serve_lib.sh"
lt=""
cleanup() { [ -n "$lt" ] && kill "$lt" 2>/dev/null; kill ${srv:-} 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT
start_server "$model" "$out/server.log" "$@"
load() { python3 -m loadtest --url "http://127.0.0.1:$port" --prompt-words "$words-$words" \
  --max-tokens 128 --no-leak-check ${LOAD_ARGS:-} "$@"; }
load --concurrency 4 --requests 8 > /dev/null
load --concurrency "$c" --requests "${REQUESTS:-$((c * 4))}" > "$out/load.txt" 2>&1 &
lt=$!
sleep 4
pids="$srv $(cat /proc/$srv/task/*/children 2>/dev/null)"
ticks() { for p in $pids; do for t in /proc/$p/task/*; do
  echo "$p $(cat $t/comm | tr ' ' _) $(awk '{print $14 + $15}' $t/stat 2>/dev/null || echo 0)"; done; done; }
{ date +%s.%N; ticks; } > "$out/ticks-start.txt"
for p in $pids; do
  "$spy" record --pid "$p" --duration 12 --rate 200 --threads --nonblocking --format raw \
    --output "$out/spy-$p.txt" > /dev/null 2>&1 &
done
wait $(jobs -p | grep -v "^$lt$" | grep -v "^$srv$") 2>/dev/null || true
{ date +%s.%N; ticks; } > "$out/ticks-end.txt"
{ for p in $pids; do echo "$p $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-120)"; done
  echo "--- start"; cat "$out/ticks-start.txt"; echo "--- end"; cat "$out/ticks-end.txt"
} > "$out/info.txt"
rm -f "$out/ticks-start.txt" "$out/ticks-end.txt"
wait "$lt" || true
lt=""
cat "$out/load.txt" | tail -5
