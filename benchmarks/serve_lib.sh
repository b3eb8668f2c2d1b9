# Sourced by the benchmark scripts: one of our servers on a free loopback port, started the
# same way for every measurement.
#
#   start_server MODEL_DIR LOG [server flags...]   sets $port and $srv (its pid), waits for /ready
#   gpu_model SHAPE   prints the directory of the random-weight SHAPE model (bf16, the shipped
#                     tokenizer's vocabulary) under ${TMPDIR:-/tmp}/vq-models, written once
start_server() {
  local model=$1 log=$2; shift 2
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  python3 -m veloxquant_mlx.server --model "$model" --port "$port" --blas off --max-running 256 \
    --max-queue 1024 --kv-cache-mb 4096 --log-level warning "$@" > "$log" 2>&1 &
  srv=$!
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$port/ready" >/dev/null && return 0
    kill -0 "$srv" 2>/dev/null || { tail -20 "$log"; exit 1; }
    sleep 0.5
  done
}

gpu_model() {
  local dir=${TMPDIR:-/tmp}/vq-models/model-$1
  python3 -c "from pathlib import Path; from benchmarks.serving import write_model
p = Path('$dir')
if not (p / 'config.json').exists():
    write_model(p, '$1', 'bfloat16', True)" >&2
  echo "$dir"
}
