#!/usr/bin/env bash
# micro_batch_bench.sh: two micro-batches in flight (--micro-batches 2) against whole calls, on a
# batch of decode rows and on a long prompt, interleaved.
#
#   bench/micro_batch_bench.sh MODEL_DIR [colibri-node binary]   (default: build/src/colibri-node)
#
# For each of RUNS rounds (default 3), and in each round for --micro-batches 1 and 2 in turn, runs
#   decode:  mpirun -np NP colibri-node --model MODEL_DIR --prompt-ids 1,2,3,4 --ngen NGEN
#              --ignore-eos --sequences SEQS --micro-batches M --profile-json ...
#   prefill: mpirun -np NP colibri-node --model MODEL_DIR --prompt-ids <PROMPT ids> --ngen 1
#              --max-rows MAX_ROWS --micro-batches M --profile-json ...
# (NP 2, SEQS 16, NGEN 16, PROMPT 2048 tokens, MAX_ROWS 256 by default) and prints per mode the
# median aggregate decode tok/s, the median prompt tok/s (prompt tokens over TTFT), and the
# coordinator's wait for the expert ranks (wait_slowest) as a share of the run's prefill + decode
# time, with every run's value. OUT keeps the profiles (default: a temporary directory).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
model=${1:?usage: micro_batch_bench.sh MODEL_DIR [colibri-node]}
node=${2:-$root/build/src/colibri-node}
runs=${RUNS:-3} np=${NP:-2} seqs=${SEQS:-16} ngen=${NGEN:-16} prompt=${PROMPT:-2048}
max_rows=${MAX_ROWS:-256}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
export OMP_WAIT_POLICY=PASSIVE
if [[ -n ${OUT:-} ]]; then
  tmp=$OUT
  mkdir -p "$tmp"
else
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
fi
prompt_ids=$(python3 -c "print(','.join(str(1 + (i * 37) % 1000) for i in range($prompt)))")

echo "micro_batch_bench: $model, np $np, $runs interleaved rounds"
echo "machine: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1) |" \
     "$(getconf _NPROCESSORS_ONLN) cores | $(mpirun --version | head -n 1) |" \
     "load average $(cut -d' ' -f1-3 /proc/loadavg)"

run_node() {  # name, args...
  local name=$1
  shift
  mpirun --oversubscribe -np "$np" "$node" --model "$model" --quiet --profile-json "$tmp/$name.json" \
    "$@" >/dev/null 2>"$tmp/log" ||
    { cat "$tmp/log" >&2; echo "micro_batch_bench: run $name failed" >&2; exit 1; }
}

for ((run = 0; run < runs; ++run)); do
  for m in 1 2; do
    run_node "decode-$m-$run" --prompt-ids 1,2,3,4 --ngen "$ngen" --ignore-eos --sequences "$seqs" \
      --micro-batches "$m"
    run_node "prefill-$m-$run" --prompt-ids "$prompt_ids" --ngen 1 --max-rows "$max_rows" \
      --micro-batches "$m"
  done
done

python3 - "$tmp" "$runs" "$seqs" "$prompt" <<'PY'
import json, statistics, sys
tmp, runs, seqs, prompt = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]

def wait_share(d):
    coord = next(r for r in d["ranks"] if r["role"] == "coordinator")
    seconds = d["run"]["prefill_seconds"] + d["run"]["decode_seconds"]
    return 100 * coord["phases_us"].get("wait_slowest", 0) / 1e6 / max(seconds, 1e-9)

rows = {}
for m in (1, 2):
    dec = [json.load(open(f"{tmp}/decode-{m}-{r}.json")) for r in range(runs)]
    pre = [json.load(open(f"{tmp}/prefill-{m}-{r}.json")) for r in range(runs)]
    rows[m] = {
        "decode_tok_per_s": [d["run"]["decode_tok_per_s"] for d in dec],
        "decode_wait_pct": [wait_share(d) for d in dec],
        "prompt_tok_per_s": [d["run"]["prefill_tokens"] / d["run"]["ttft_seconds"] for d in pre],
        "prefill_wait_pct": [wait_share(d) for d in pre],
    }
fmt = lambda v: f"{statistics.median(v):.2f} ({', '.join(f'{x:.2f}' for x in v)})"
print(f"\n{'micro-batches':>13} | decode {seqs} seqs tok/s | wait % | prompt {prompt} tok/s | wait %")
for m in (1, 2):
    r = rows[m]
    print(f"{m:>13} | {fmt(r['decode_tok_per_s'])} | {fmt(r['decode_wait_pct'])} | "
          f"{fmt(r['prompt_tok_per_s'])} | {fmt(r['prefill_wait_pct'])}")
    print(json.dumps({"bench": "micro_batches", "micro_batches": m, "sequences": int(seqs),
                      "prompt_tokens": int(prompt), **r}))
for key in ("decode_tok_per_s", "prompt_tok_per_s"):
    print(f"{key}: x{statistics.median(rows[2][key]) / statistics.median(rows[1][key]):.2f} with two")
PY
