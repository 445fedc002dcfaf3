#!/usr/bin/env bash
# kv_cache_dir_ttft.sh: time to first token of a repeated long prompt on a fresh server without
# --kv-cache-dir (the prompt computed) and on a server restarted with it (the prompt's prefix
# loaded from disk). Every run starts a new server, so the in-memory prefix cache never serves the
# prompt; a first run with the directory, not counted, writes its files. TTFT is the server's own
# (colibri_time_to_first_token_seconds_sum after the one request); the client's time for the
# whole request (max_tokens 1) and the disk load's time (colibri_kv_cache_dir_load_seconds_total)
# are printed next to it. Medians, min and max over RUNS.
#
#   bench/kv_cache_dir_ttft.sh [MODEL_DIR]   (default: models/glm5-tiny-kjv)
#   NP (1), TOKENS (1500 prompt token ids), RUNS (5), EXTRA (server flags)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=bench/serve_start.sh
source "$root/bench/serve_start.sh"
model=${1:-$root/models/glm5-tiny-kjv}
np=${NP:-1} tokens=${TOKENS:-1500} runs=${RUNS:-5}
node=$root/build/src/colibri-node
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMP_WAIT_POLICY=PASSIVE
work=$(mktemp -d)
server=
trap '[[ -n $server ]] && kill -TERM $server 2>/dev/null; wait 2>/dev/null || true; rm -rf "$work"' EXIT

# The prompt: TOKENS token ids (no tokenizer in the way), the same every run.
python3 -c "
import json
ids = [100 + (i * 7919 + 104729) % 3900 for i in range($tokens)]
print(json.dumps({'prompt': ids, 'max_tokens': 1, 'temperature': 0}))" >"$work/request.json"

launch=("$node")
((np > 1)) && launch=(mpirun --oversubscribe -np "$np" "$node")

metric() { grep "^$1 " "$work/metrics" | awk '{print $2}' || echo 0; }

# One run: a new server (flags in $@), one request, its numbers appended to $work/$label.
run_once() {
  local label=$1
  shift
  "${launch[@]}" --model "$model" --serve --port 0 --quiet --kv-tokens 16384 ${EXTRA:-} "$@" \
    2>"$work/log" &
  server=$!
  wait_for_server "$work/log" $server
  local client
  client=$(curl -sf -o "$work/reply" -w '%{time_total}' -H 'Content-Type: application/json' \
    --data-binary @"$work/request.json" "http://127.0.0.1:$port/v1/completions")
  curl -sf "http://127.0.0.1:$port/metrics" >"$work/metrics"
  kill -TERM $server
  wait $server 2>/dev/null || true
  server=
  echo "$(metric colibri_time_to_first_token_seconds_sum) $client" \
    "$(metric colibri_kv_cache_dir_prompt_tokens_total)" \
    "$(metric colibri_kv_cache_dir_load_seconds_total)" \
    "$(python3 -c "import json,sys; print(json.load(open('$work/reply'))['usage']['prompt_tokens_details']['cached_tokens'])")" \
    >>"$work/$label"
}

for _ in $(seq 1 "$runs"); do run_once computed; done
run_once populate --kv-cache-dir "$work/kv"
for _ in $(seq 1 "$runs"); do run_once from_disk --kv-cache-dir "$work/kv"; done

python3 - "$work" "$tokens" "$np" "$runs" "$(lscpu | sed -n 's/^Model name: *//p')" <<'PY'
import json, statistics, sys
work, tokens, np, runs, cpu = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
out = {"prompt_tokens": tokens, "np": np, "runs": runs, "cpu": cpu}
for label in ("computed", "from_disk"):
    rows = [list(map(float, line.split())) for line in open(f"{work}/{label}")]
    ttft = [r[0] * 1e3 for r in rows]
    client = [r[1] * 1e3 for r in rows]
    load = [r[3] * 1e3 for r in rows]
    cached = sorted({int(r[4]) for r in rows})
    out[label] = {"ttft_ms_median": statistics.median(ttft), "ttft_ms_min": min(ttft),
                  "ttft_ms_max": max(ttft), "request_ms_median": statistics.median(client),
                  "load_ms_median": statistics.median(load), "cached_tokens": cached}
    print(f"{label:10s} TTFT median {statistics.median(ttft):8.1f} ms (min {min(ttft):.1f}, max "
          f"{max(ttft):.1f}), request {statistics.median(client):8.1f} ms, disk load "
          f"{statistics.median(load):6.1f} ms, cached_tokens {cached}")
print(json.dumps(out))
PY
