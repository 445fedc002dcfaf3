#!/usr/bin/env bash
# Fuzzes one target with libFuzzer (clang, ASan+UBSan) for a while: tests/fuzz/README.md.
#   tests/fuzz/run_libfuzzer.sh TARGET [SECONDS] [-- LIBFUZZER_FLAGS...]
# Builds build-fuzz/ (configured on first use) and only the target. New inputs go to
# build-fuzz/corpus/TARGET (seeded from tests/fuzz/corpus/TARGET, which stays untouched), findings
# to build-fuzz/findings/. Environment: CXX (default clang++-14), JOBS (default 2).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
target=${1:?usage: run_libfuzzer.sh TARGET [SECONDS] [-- FLAGS...]}
seconds=${2:-600}
shift $(($# >= 2 ? 2 : 1))
[[ ${1:-} == -- ]] && shift

build=build-fuzz
if [[ ! -f $build/CMakeCache.txt ]]; then
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER="${CXX:-clang++-14}" \
    -DCOLIBRI_SANITIZE=ON -DCOLIBRI_LIBFUZZER=ON -DCOLIBRI_CUDA=OFF
fi
cmake --build "$build" -j "${JOBS:-2}" --target "libfuzzer_${target}"

corpus=$build/corpus/$target
mkdir -p "$corpus" "$build/findings"
cp -n tests/fuzz/corpus/"$target"/* "$corpus"/
exec "$build/tests/fuzz/libfuzzer_${target}" -max_total_time="$seconds" -timeout=20 \
  -rss_limit_mb=2048 -malloc_limit_mb=1024 -artifact_prefix="$build/findings/${target}-" \
  -print_final_stats=1 "$@" "$corpus"
