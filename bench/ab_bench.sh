#!/usr/bin/env bash
# ab_bench.sh: two builds of colibri-node, interleaved: decode tok/s of the tiny glm5 model (np 1
# and 2, bench/decode_bench.sh) and the MPI exchange's cost per MoE layer (np 2, exchange_bench at
# 1, 8 and 64 rows), ROUNDS rounds (default 5), each running A then B, one run of each measure per
# side per round; then the medians and B / A.
#
#   bench/ab_bench.sh A_DIR B_DIR     (each holding colibri-node and exchange_bench)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[[ $# -eq 2 ]] || { echo "usage: bench/ab_bench.sh A_DIR B_DIR" >&2; exit 2; }
for dir in "$1" "$2"; do
  for binary in colibri-node exchange_bench; do
    [[ -x $dir/$binary ]] || { echo "ab_bench: $dir/$binary is not an executable" >&2; exit 2; }
  done
done
rounds=${ROUNDS:-5}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
export OMP_NUM_THREADS=1
log=$(mktemp)
trap 'rm -f "$log"' EXIT
echo "ab_bench: A $1, B $2, $rounds rounds | $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)" \
     "| $(getconf _NPROCESSORS_ONLN) cores | load average $(cut -d' ' -f1-3 /proc/loadavg)"
for ((round = 1; round <= rounds; ++round)); do
  for side in A B; do
    dir=$1
    [[ $side == B ]] && dir=$2
    for np in 1 2; do
      echo "decode $side np$np $(RUNS=1 NPS=$np bash "$root/bench/decode_bench.sh" "$dir/colibri-node" |
        grep '"bench":"decode"')" >>"$log"
    done
    mpirun --oversubscribe -np 2 "$dir/exchange_bench" --rows 1,8,64 --iters 300 --warmup 50 |
      grep '"bench":"exchange"' | sed "s/^/exchange $side /" >>"$log"
  done
done
python3 - "$log" <<'PY'
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    kind, side, rest = line.split(" ", 2)
    if kind == "decode":
        np, text = rest.split(" ", 1)
        runs.setdefault((f"decode tok/s {np}", side), []).append(json.loads(text)["median_tok_per_s"])
    else:
        d = json.loads(rest)
        runs.setdefault((f"exchange us, {d['rows']} rows", side), []).append(d["median_us"])
print(f"{'measure':<26} {'A':>10} {'B':>10} {'B / A':>7}  runs A | runs B")
for name in dict.fromkeys(k for k, _ in runs):
    a, b = runs[(name, "A")], runs[(name, "B")]
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"{name:<26} {ma:>10.2f} {mb:>10.2f} {mb / ma:>7.3f}  {a} | {b}")
PY
