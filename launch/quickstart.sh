#!/usr/bin/env bash
# The first command to run: installs the build dependencies, builds colibri-node and generates
# 12 tokens greedily with the tiny GLM-5 model committed in tests/data, first in one process,
# then as a 7-rank job on this machine (coordinator + 6 CPU expert ranks, hostfiles/localhost).
# Environment: JOBS (build parallelism, default: all cores).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash launch/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build -j "${JOBS:-$(nproc)}"

fixture=tests/data/parity/glm5
meta=$fixture/golden/meta.json
if [[ ! -f $meta || ! -d $fixture/model ]]; then
  echo "quickstart: the GLM-5 test model is missing ($fixture)" >&2
  exit 1
fi
# json_ids KEY: the integer list stored under KEY in meta.json, comma-separated.
json_ids() { tr -d ' \n' <"$meta" | sed -n "s/.*\"$1\":\[\([0-9,]*\)\].*/\1/p"; }
prompt_ids=$(json_ids prompt_ids)
if [[ -z $prompt_ids ]]; then
  echo "quickstart: no prompt_ids in $meta" >&2
  exit 1
fi

node=(build/src/colibri-node --model "$fixture/model" --prompt-ids "$prompt_ids" --ngen 12)
echo "prompt ids:         $prompt_ids"
echo "transformers gives: $(json_ids greedy_ids | tr , ' ')"
echo
echo "== one process: ${node[*]}"
"${node[@]}"

# Open MPI, for this run only: allow root (containers) and let waiting ranks yield their core.
echo
echo "== 7 ranks: mpirun --hostfile hostfiles/localhost -np 7 ${node[*]}"
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 \
  mpirun --hostfile hostfiles/localhost -np 7 "${node[@]}"
