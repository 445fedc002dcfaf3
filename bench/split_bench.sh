#!/usr/bin/env bash
# split_bench.sh: mpirun -np 2 with one thread a rank against one process with two threads, on the
# GLM-5.2-shaped slice, with and without --split-linears (and with its attention heads kept on the
# coordinator), interleaved.
#
#   bench/split_bench.sh            ROUNDS (default 5), NGEN (default 64), SLICE (default
#                                   /tmp/glm52-slice, made by colibri-gen-bench-model when missing)
#
# Each round runs, one after the other, decode of NGEN tokens after a 4-token prompt (greedy,
# --ignore-eos) in five ways:
#   one      one process, OMP_NUM_THREADS=2
#   split    np 2, --split-linears, the default layout (the expert rank owns every routed expert)
#   split38  np 2, --split-linears, the coordinator owns 3/8 of the routed experts (layout RAM
#            budgets 6 and 10 GiB): with its shared expert, about as many bytes a token as the
#            expert rank's 5/8
#   lin38    split38 with COLIBRI_SPLIT_HEADS=0: the linears split, the attention's heads all on
#            the coordinator
#   sliced38 split38 with --placement sliced: each rank holds its budget's share of every routed
#            expert's intermediate rows (3/8 on the coordinator), so a token's expert work splits
#            the same way whatever experts it routes to
#   np2_88   np 2 without --split-linears, each rank owns half the routed experts (8 + 8 GiB): the
#            best np 2 before split linears
# then quant_bench's read loop at two threads (the machine's read bandwidth that round). Prints each
# round's tok/s and its ratios to `one`, then the median of each ratio over rounds.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build}
rounds=${ROUNDS:-5}
ngen=${NGEN:-64}
slice=${SLICE:-/tmp/glm52-slice}
node=$build/src/colibri-node
gen=$build/src/colibri-gen-bench-model
quant_bench=$build/bench/quant_bench
for bin in "$node" "$gen" "$quant_bench"; do
  [[ -x $bin ]] || { echo "split_bench: $bin missing (build first; BUILD_DIR=$build)" >&2; exit 2; }
done
[[ -f $slice/config.json ]] || "$gen" "$slice" >&2

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
printf '0 coordinator - - 8\n1 cpu-expert - - 8\n' > "$scratch/halves.layout"
printf '0 coordinator - - 6\n1 cpu-expert - - 10\n' > "$scratch/three-eighths.layout"
args=(--model "$slice" --prompt-ids 1,2,3,4 --ngen "$ngen" --ignore-eos)
mpi=(mpirun --oversubscribe --mca btl_vader_eager_limit 65536 --mca btl_vader_max_send_size 65536
     -x OMP_NUM_THREADS -np 2)

# decode tok/s from the run line "... decode M tok in Y s (Z tok/s) ..."
rate() { sed -n 's/.*decode [0-9]* tok in [0-9.]* s (\([0-9.]*\) tok\/s).*/\1/p' | head -n 1; }
median() { sort -g | awk '{v[NR]=$1} END {if (NR == 0) print "nan"; else if (NR % 2) print v[(NR+1)/2]; else print (v[NR/2]+v[NR/2+1])/2}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {if (a == "" || b == "" || b == 0) print "nan"; else printf "%.3f", a / b}'; }

echo "split_bench: $slice, decode $ngen tokens, $rounds interleaved rounds"
echo "machine: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1) |" \
     "$(getconf _NPROCESSORS_ONLN) cores | $(mpirun --version | head -n 1) | commit $(git -C "$root" rev-parse --short HEAD)"
printf '| round | one, 2 threads | split | split38 | lin38 | sliced38 | np2_88 | split / one | split38 / one | lin38 / one | sliced38 / one | np2_88 / one | read GB/s (2 threads) | load |\n'
printf '|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n'
: > "$scratch/ratios"
for round in $(seq 1 "$rounds"); do
  one=$(OMP_NUM_THREADS=2 "$node" "${args[@]}" 2>&1 | rate)
  split=$(OMP_NUM_THREADS=1 "${mpi[@]}" "$node" "${args[@]}" --split-linears 2>&1 | rate)
  split38=$(OMP_NUM_THREADS=1 "${mpi[@]}" "$node" "${args[@]}" --split-linears \
            --layout "$scratch/three-eighths.layout" 2>&1 | rate)
  lin38=$(COLIBRI_SPLIT_HEADS=0 OMP_NUM_THREADS=1 "${mpi[@]}" -x COLIBRI_SPLIT_HEADS "$node" "${args[@]}" \
          --split-linears --layout "$scratch/three-eighths.layout" 2>&1 | rate)
  sliced38=$(OMP_NUM_THREADS=1 "${mpi[@]}" "$node" "${args[@]}" --split-linears \
             --layout "$scratch/three-eighths.layout" --placement sliced 2>&1 | rate)
  np2_88=$(OMP_NUM_THREADS=1 "${mpi[@]}" "$node" "${args[@]}" --layout "$scratch/halves.layout" 2>&1 | rate)
  read=$("$quant_bench" --experts 2 --batch 1 --threads 2 --activations int8 --reps 5 --read-mib 1024 \
         2>/dev/null | sed -n 's/.*"read_gbps":{"median":\([0-9.]*\).*/\1/p' | head -n 1)
  r1=$(ratio "$split" "$one") r2=$(ratio "$split38" "$one") r3=$(ratio "$np2_88" "$one")
  r4=$(ratio "$lin38" "$one") r5=$(ratio "$sliced38" "$one")
  echo "$r1 $r2 $r3 $r4 $r5" >> "$scratch/ratios"
  printf '| %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$round" "$one" \
    "$split" "$split38" "$lin38" "$sliced38" "$np2_88" "$r1" "$r2" "$r4" "$r5" "$r3" "${read:-nan}" \
    "$(cut -d' ' -f1 /proc/loadavg)"
done
echo
echo "medians over rounds: split / one $(cut -d' ' -f1 "$scratch/ratios" | median)," \
     "split38 / one $(cut -d' ' -f2 "$scratch/ratios" | median)," \
     "lin38 / one $(cut -d' ' -f4 "$scratch/ratios" | median)," \
     "sliced38 / one $(cut -d' ' -f5 "$scratch/ratios" | median)," \
     "np2_88 / one $(cut -d' ' -f3 "$scratch/ratios" | median)"
