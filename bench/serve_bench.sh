#!/usr/bin/env bash
# serve_bench.sh: starts `mpirun -np NP colibri-node --serve` on MODEL, waits for /health, runs
# build/bench/serve_bench (aggregate streamed tok/s, TTFT, inter-token latency p50/p99 at 1, 4,
# 16 and 64 concurrent streaming clients), then stops the server.
#
#   bench/serve_bench.sh [MODEL_DIR]   (default: models/glm5-tiny-kjv)
#   NP (7), MAX_TOKENS (64), REQUESTS (2 per client), CLIENTS ("1 4 16 64"), EXTRA (server flags)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=bench/serve_start.sh
source "$root/bench/serve_start.sh"
model=${1:-$root/models/glm5-tiny-kjv}
np=${NP:-7} max_tokens=${MAX_TOKENS:-64} requests=${REQUESTS:-2} clients=${CLIENTS:-1 4 16 64}
node=$root/build/src/colibri-node bench=$root/build/bench/serve_bench
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1
log=$(mktemp)
# 64 streams at once: 64 sequence slots, KV for 64 x (prompt + max_tokens).
mpirun --oversubscribe -np "$np" "$node" --model "$model" --serve --port 0 --quiet \
  --max-seqs 64 --max-queue 128 --kv-tokens 16384 ${EXTRA:-} 2>"$log" &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true; rm -f "$log"' EXIT
wait_for_server "$log" $server
# shellcheck disable=SC2086
"$bench" --port "$port" --clients $clients --requests "$requests" --max-tokens "$max_tokens" \
  --label "$(basename "$model") np $np, $(mpirun --version | head -n 1)"
