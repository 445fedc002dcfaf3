#!/usr/bin/env bash
# soak.sh: `mpirun -np NP colibri-node --serve` on MODEL under build/bench/soak_bench (CLIENTS
# clients for SECONDS: mixed streamed, non-streamed, dropped and invalid requests; greedy answers
# checked against each request sent alone), while every rank's resident memory is sampled every
# 10 s; at the end the server's KV and request gauges, then a clean stop.
#
#   bench/soak.sh [MODEL_DIR]   (default: models/glm5-tiny-kjv)
#   NP (7), CLIENTS (64), SOAK_SECONDS (1800), EXTRA (server flags), OUT (directory for the logs)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=bench/serve_start.sh
source "$root/bench/serve_start.sh"
model=${1:-$root/models/glm5-tiny-kjv}
np=${NP:-7} clients=${CLIENTS:-64} seconds=${SOAK_SECONDS:-1800}
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
node=$root/build/src/colibri-node bench=$root/build/bench/soak_bench
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1
log=$out/server.log
mpirun --oversubscribe -np "$np" "$node" --model "$model" --serve --port 0 --quiet \
  --max-seqs 64 --max-queue 256 --kv-tokens 16384 --routing-stats off ${EXTRA:-} 2>"$log" &
server=$!
trap 'kill -TERM $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
wait_for_server "$log" $server
# Every rank's VmRSS (kB) every 10 s: "seconds rank0 rank1 ...", ranks by their OMPI rank.
(
  start=$SECONDS
  while kill -0 $server 2>/dev/null; do
    line="$((SECONDS - start))"
    for pid in $(pgrep -f "^$node" | sort -n); do
      rank=$(tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | sed -n 's/^OMPI_COMM_WORLD_RANK=//p')
      [[ -n $rank ]] || continue
      rss=$(awk '/^VmRSS:/ { print $2 }' "/proc/$pid/status" 2>/dev/null)
      line+=" r${rank}:${rss}"
    done
    echo "$line"
    sleep 10
  done
) >"$out/rss.txt" &
sampler=$!
code=0
"$bench" --port "$port" --clients "$clients" --seconds "$seconds" \
  --label "$(basename "$model") np $np ${EXTRA:-}" | tee "$out/soak.txt" || code=$?
metrics=$(curl -sf "http://127.0.0.1:$port/metrics")
grep -E '^colibri_(kv_blocks_(total|free|running|cached)|num_requests_(running|waiting)) ' \
  <<<"$metrics" | tee "$out/gauges.txt"
kill -TERM $server
wait $server || true
kill $sampler 2>/dev/null || true
echo "soak: logs in $out (rss.txt: seconds and every rank's VmRSS in kB)"
exit $code
