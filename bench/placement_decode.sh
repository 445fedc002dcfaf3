#!/usr/bin/env bash
# placement_decode.sh: decode on the embedded model at np 7 with RAM budgets that hold about a
# fifth of each rank's experts (the rest read from the disk tier, the page cache here), interleaved
# rounds of: every expert resident (the ceiling), balanced, balanced + --prefetch-ahead, heat,
# heat + --prefetch-ahead, and heat with two thirds of the budget pinned to each rank's hottest
# experts (--pin-gb) + --prefetch-ahead. Heat uses statistics learned first on the KJV corpus (not the prompt).
#   ROUNDS=5 bench/placement_decode.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build}
model=$root/models/glm5-tiny-kjv
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
stats=$work/kjv.stats
# Learn: teacher-forced over 4 pieces of the corpus (each within the model's context).
for i in 0 1 2 3; do
  head -c $(((i + 1) * 7000)) "$root/tests/data/tokenizer/corpus.txt" | tail -c 7000 >"$work/piece"
  "$build/src/colibri-node" --model "$model" --score "$work/piece" --routing-stats "$stats" \
    --quiet >/dev/null
done
prompt="And it came to pass after these things, that God did tempt Abraham"
budget=(--ram-gb 0.0015)
for r in $(seq 1 "${ROUNDS:-5}"); do
  for config in resident balanced balanced+prefetch heat heat+prefetch heat+pin+prefetch; do
    args=(--model "$model" --prompt "$prompt" --ngen 384 --ignore-eos)
    case $config in
      resident) args+=(--routing-stats off) ;;
      balanced) args+=("${budget[@]}" --routing-stats off) ;;
      balanced+prefetch) args+=("${budget[@]}" --routing-stats off --prefetch-ahead) ;;
      heat) args+=("${budget[@]}" --placement heat --routing-stats "$stats") ;;
      heat+prefetch) args+=("${budget[@]}" --placement heat --routing-stats "$stats" --prefetch-ahead) ;;
      heat+pin+prefetch)
        args+=("${budget[@]}" --pin-gb 0.001 --placement heat --routing-stats "$stats" --prefetch-ahead)
        ;;
    esac
    cp "$stats" "$work/before"  # heat reads the learned file; this run's merge is undone below
    out=$(mpirun -np 7 "$build/src/colibri-node" "${args[@]}" 2>&1 >/dev/null)
    cp "$work/before" "$stats"
    tok_s=$(grep -o 'decode [0-9]* tok in [0-9.]* s ([0-9.]* tok/s)' <<<"$out" | grep -o '([0-9.]*' | tr -d '(')
    # The tier table: rank, pinned, ram, disk hits, disk read (a number and a unit), loader ms,
    # waited ms, hinted reads, hint hits.
    waited=$(awk '$1 ~ /^[0-9]+$/ && $6 ~ /B$/ { w += $8 } END { printf "%.1f", w }' <<<"$out")
    echo "round $r $config decode_tok_s $tok_s waited_ms $waited"
  done
done
