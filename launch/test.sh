#!/usr/bin/env bash
# Installs what the tests need (install-deps.sh: nothing when present), then builds and runs the
# whole test suite from a clean checkout, in two build trees:
#   build/       RelWithDebInfo, COLIBRI_CUDA=AUTO (CUDA kernels when nvcc is found): everything,
#                all tests
#   build-asan/  ASan + UBSan, COLIBRI_CUDA=OFF: what the tests labelled `sanitize` run (target
#                colibri_sanitize_tests), those tests
# Every stage runs even when an earlier one failed; the exit status is non-zero if any failed.
# Environment: JOBS (build parallelism, default: all cores).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Open MPI, for this script only: allow running as root (containers, CI), allow more ranks than
# cores on small machines, and let waiting ranks yield their core instead of spinning.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_rmaps_base_oversubscribe=1
# OpenMP threads sleep instead of spinning when idle: tests share few cores with many ranks.
export OMP_WAIT_POLICY=PASSIVE

jobs=${JOBS:-$(nproc)}
failed=()

# stage NAME COMMAND...: runs one step, records its failure, returns its status.
stage() {
  local name=$1
  shift
  echo "==> ${name}: $*"
  local start=$SECONDS status=0
  "$@" || status=$?
  echo "==> ${name}: $([[ $status == 0 ]] && echo ok || echo "FAILED (exit ${status})")" \
    "in $((SECONDS - start)) s"
  if [[ $status != 0 ]]; then failed+=("$name"); fi
  return "$status"
}

# suite DIR TARGET CTEST_ARGS -- CMAKE_ARGS...: configure, compile TARGET and test one build tree;
# stops at the first failed stage of that tree.
suite() {
  local dir=$1 target=$2 ctest_args=()
  shift 2
  while [[ $1 != -- ]]; do ctest_args+=("$1"); shift; done
  shift
  stage "configure ${dir}" cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" || return 0
  stage "compile ${dir}" cmake --build "$dir" -j "$jobs" --target "$target" || return 0
  stage "test ${dir}" ctest --test-dir "$dir" --output-on-failure --no-tests=error \
    "${ctest_args[@]}" || return 0
}

stage "dependencies" bash launch/install-deps.sh || true
suite build all -- -DCOLIBRI_CUDA=AUTO
suite build-asan colibri_sanitize_tests -L sanitize -- -DCOLIBRI_SANITIZE=ON -DCOLIBRI_CUDA=OFF

if ((${#failed[@]} > 0)); then
  echo "test.sh: FAILED: ${failed[*]}"
  exit 1
fi
echo "test.sh: all stages passed"
