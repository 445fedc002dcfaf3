#!/usr/bin/env bash
# decode_bench.sh: decode tokens/s of colibri-node at several rank counts.
#
#   bench/decode_bench.sh [colibri-node binary]        (default: build/src/colibri-node)
#
# Runs the committed tiny glm5 model (tests/data/parity/glm5) with --ngen 64 --ignore-eos,
# RUNS times (default 5) at each rank count in NPS (default "1 2 7"), and prints the median
# decode tok/s per rank count (from the run line "... decode M tok in Y s (Z tok/s) ..."), then
# one JSON line per rank count. The model is tiny: a decode step costs microseconds of compute,
# so at np > 1 this measures the per-layer exchange overhead of the transport, not expert
# compute. OMP_NUM_THREADS=1 for every rank, so np 1 does not get more cores than each rank of
# a larger run. Extra mpirun options: MPIRUN_ARGS, e.g.
# MPIRUN_ARGS="--mca btl_vader_single_copy_mechanism none".
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
node=${1:-$root/build/src/colibri-node}
mpirun=${MPIRUN:-mpirun}
runs=${RUNS:-5}
nps=${NPS:-1 2 7}
ngen=64
fixture=$root/tests/data/parity/glm5
model=$fixture/model

[[ -x $node ]] || { echo "decode_bench: $node is not an executable (build first, or pass the path)" >&2; exit 2; }
# "prompt_ids": [4, 203, ...] from meta.json, as 4,203,...
prompt=$(tr -d ' \n\t' < "$fixture/golden/meta.json" | sed -n 's/.*"prompt_ids":\[\([0-9,]*\)\].*/\1/p')
[[ -n $prompt ]] || { echo "decode_bench: no prompt_ids in $fixture/golden/meta.json" >&2; exit 2; }

export OMP_NUM_THREADS=1 OMPI_MCA_mpi_yield_when_idle=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

cores=$(getconf _NPROCESSORS_ONLN)  # not nproc: it honours OMP_NUM_THREADS
echo "decode_bench: colibri-node decode tok/s, tiny glm5 model, --ngen $ngen --ignore-eos, $runs runs per np"
echo "machine: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1) | $cores cores |" \
     "$("$mpirun" --version | head -n 1) | load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "OMP_NUM_THREADS=1 per rank; the model is tiny, so np > 1 measures the per-layer exchange overhead"
echo

printf '%4s  %14s  %s\n' np "median tok/s" "all runs (tok/s)"
json_lines=()
for np in $nps; do
  rates=()
  for ((i = 0; i < runs; ++i)); do
    # shellcheck disable=SC2086  # MPIRUN_ARGS is a list of options
    log=$("$mpirun" --oversubscribe ${MPIRUN_ARGS:-} -np "$np" "$node" --model "$model" --prompt-ids "$prompt" \
            --ngen "$ngen" --ignore-eos 2>&1 >/dev/null) || { echo "$log" >&2; echo "decode_bench: np $np failed" >&2; exit 1; }
    rate=$(sed -n 's/.*decode [0-9]* tok in [0-9.]* s (\([0-9.]*\) tok\/s).*/\1/p' <<<"$log")
    [[ -n $rate ]] || { echo "$log" >&2; echo "decode_bench: no run line at np $np" >&2; exit 1; }
    rates+=("$rate")
  done
  median=$(printf '%s\n' "${rates[@]}" | sort -g | sed -n "$(((runs + 1) / 2))p")
  note=""
  ((np > cores)) && note="  (oversubscribed: $np ranks on $cores cores)"
  printf '%4s  %14s  %s%s\n' "$np" "$median" "${rates[*]}" "$note"
  json_lines+=("{\"bench\":\"decode\",\"ranks\":$np,\"ngen\":$ngen,\"runs\":$runs,\"median_tok_per_s\":$median,\"tok_per_s\":[$(IFS=,; echo "${rates[*]}")]}")
done
printf '%s\n' "${json_lines[@]}"
