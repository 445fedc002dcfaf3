#!/usr/bin/env bash
# The first command to run: installs the build dependencies, builds colibri-node and runs the
# main job, `mpirun -np 7 colibri-node` (through launch/colibri-launch, which adds what this
# machine needs: root, oversubscription, one OpenMP thread per rank when cores are few) on the
# embedded model: a coordinator and six CPU expert ranks write a continuation of a prompt, then
# a four-line summary of the cluster (ranks, experts per rank, speed, sampling).
# Environment: JOBS (build parallelism, default: all cores), PROMPT, NGEN, TEMP (0: greedy),
# TOP_P, SEED.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash launch/install-deps.sh --build-only
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build -j "${JOBS:-$(nproc)}" --target colibri-node

prompt=${PROMPT:-"And God said,"}
ngen=${NGEN:-64}
# Greedy decoding still repeats itself more on this small model (its greedy continuations reuse
# about a quarter of their token 3-grams); sampling at temperature 0.7 and top-p 0.9 reads better.
# TEMP=0 is greedy.
sampling=(--temp "${TEMP:-0.7}" --top-p "${TOP_P:-0.9}" --seed "${SEED:-1}")
echo
echo "== mpirun -np 7 colibri-node --prompt \"$prompt\" --ngen $ngen ${sampling[*]} --summary   (model: models/glm5-tiny-kjv)"
launch/colibri-launch --hostfile hostfiles/localhost --np 7 -- --prompt "$prompt" --ngen "$ngen" \
  "${sampling[@]}" --summary
