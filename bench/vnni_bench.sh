#!/usr/bin/env bash
# vnni_bench.sh: the AVX2 int8-activation kernels with VNNI (AVX-VNNI where the CPU has it) against
# pmaddubsw (COLIBRI_VNNI=0), interleaved: quant_bench at batch 1 and 8 (int4 g64 and int8 rows,
# one thread, tiles) and colibri-node's 128-token prefill then 15 decode tokens at 1 and 2 threads
# with COLIBRI_ISA=avx2.
#   MODEL=<container dir> ROUNDS=5 bench/vnni_bench.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build}
model=${MODEL:?MODEL: a colibri container (bench/peer_bench.sh makes one)}
ids=$(seq -s, 1 128)
for r in $(seq 1 "${ROUNDS:-5}"); do
  for v in 1 0; do
    for f in int4-g64 int8-row; do
      COLIBRI_VNNI=$v "$build/bench/quant_bench" --experts 32 --batch 1 8 --threads 1 --isa avx2 \
        --activations int8 --layout tiles --format $f --reps 5 --rep-seconds 0.5 2>/dev/null |
        grep '^{' | sed "s/^/round $r /"
    done
    for t in 1 2; do
      line=$(COLIBRI_VNNI=$v COLIBRI_ISA=avx2 OMP_NUM_THREADS=$t "$build/src/colibri-node" \
        --model "$model" --prompt-ids "$ids" --ngen 16 --ignore-eos 2>&1 | tail -n 1)
      echo "round $r node vnni=$v threads=$t $line"
    done
  done
done
