#!/usr/bin/env bash
# grammar_bench.sh: what constrained decoding costs a decode step. One `colibri-node --serve` on
# MODEL; CLIENTS (16) concurrent greedy streams of MAX_TOKENS (64) tokens, alternately free and
# under a response_format json_schema whose one string property must be long (minLength), so
# that both run to max_tokens; PAIRS (5) interleaved pairs, medians of aggregate tok/s and the
# inter-token latency, and their ratio.
#
#   bench/grammar_bench.sh [MODEL_DIR]   (default: models/glm5-tiny-kjv)
#   NP (1), CLIENTS (16), MAX_TOKENS (64), PAIRS (5), EXTRA (server flags)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=bench/serve_start.sh
source "$root/bench/serve_start.sh"
model=${1:-$root/models/glm5-tiny-kjv}
np=${NP:-1} clients=${CLIENTS:-16} max_tokens=${MAX_TOKENS:-64} pairs=${PAIRS:-5}
node=$root/build/src/colibri-node bench=$root/build/bench/serve_bench
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMP_WAIT_POLICY=PASSIVE
log=$(mktemp) out=$(mktemp)
mpirun --oversubscribe -np "$np" "$node" --model "$model" --serve --port 0 --quiet \
  --max-seqs 64 --max-queue 128 --kv-tokens 16384 ${EXTRA:-} 2>"$log" &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true; rm -f "$log" "$out"' EXIT
wait_for_server "$log" $server
schema='{"type": "json_schema", "json_schema": {"name": "long", "schema": {"type": "object",
  "properties": {"text": {"type": "string", "minLength": 100000}}, "required": ["text"]}}}'
for ((i = 0; i < pairs; i++)); do
  for mode in free grammar; do
    format=()
    [[ $mode == grammar ]] && format=(--response-format "$schema")
    "$bench" --port "$port" --clients "$clients" --requests 1 --max-tokens "$max_tokens" \
      --label "$mode" "${format[@]}" | grep '^{' | sed "s/^/$mode /" >> "$out"
  done
done
head -n 1 < <("$bench" --port "$port" --clients 1 --requests 1 --max-tokens 1 --label machine)
python3 - "$out" << 'PY'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    mode, text = line.split(' ', 1)
    rows.setdefault(mode, []).append(json.loads(text))
failed = sum(r['failed'] for v in rows.values() for r in v)
if failed: sys.exit(f"grammar_bench: {failed} requests failed")
med = {m: (statistics.median(r['tok_per_s'] for r in v), statistics.median(r['itl_p50_ms'] for r in v),
           sum(r['tokens'] for r in v)) for m, v in rows.items()}
for m, (tok_s, itl, tokens) in med.items():
    print(f"{m:8s} median {tok_s:8.1f} tok/s  ITL p50 {itl:6.2f} ms  ({tokens} tokens in {len(rows[m])} runs)")
print(f"grammar / free: tok/s {med['grammar'][0] / med['free'][0]:.3f}, "
      f"ITL {med['grammar'][1] / med['free'][1]:.3f}")
PY
