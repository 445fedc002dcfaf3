#!/usr/bin/env bash
# Every GPU check of the CUDA expert backend in one run, on one GPU machine, in under 6 minutes:
# device facts, the GPU tests (each CUDA kernel against its kernels/cpu oracle, int4/int8/BF16/
# fp32/NVFP4 and int4 with zero points, whole and phased as a request with VRAM misses runs; the
# CUDA expert backend against the CPU backend on every parity model (the NVFP4 copy and the
# asymmetric INT4 one as stored too), per MoE layer, with the VRAM tier holding a third of the
# experts (misses uploaded or computed on the CPU), and end to end: logits and greedy tokens),
# the block-scaled FP4 MMA test (its device quantizer on any GPU; its MMA part needs compute
# capability 12.x and is reported as SKIP elsewhere), and the kernel benchmark (grouped int4 g64 FFN on 8 experts of GLM-5.2's shape, batch 1/8/16,
# against device-to-device copy bandwidth measured in the same run; one expert's upload from
# pinned memory alone and under the batch-1 kernels, which measures the miss rule's PCIe rate).
# Then the CUDA coordinator: its kernels against their CPU oracles, the engine with the GPU
# coordinator against the CPU engine on every parity model (logits within 2e-2, greedy tokens
# equal, two sequences per batch; glm5_nvfp4 with its NVFP4 products as stored), and the decode step on a GLM-5.2-shaped slice against the
# CPU coordinator, with HBM bytes per step as a fraction of copy bandwidth.
# Writes one results file (plus a summary, the benchmark's JSON lines and the tests' XML) to
# $OUT when set, else bench/gpu-results/. Idempotent: builds, if it must, in a fresh /tmp folder.
#
# The GPU machine has the CUDA toolkit and driver, cmake and g++, but none of our Debian
# packages (no Open MPI, fmt, GoogleTest). So:
#
#   1. On the development machine (here), stage the binaries and what they need:
#        bash launch/gpu-check.sh --stage
#      builds the GPU test binaries and the benchmark (none links MPI), and packs them, the
#      non-system shared libraries they load, and GoogleTest's source into gpu-carry.tar.gz
#      (ignored by git; about 10 MiB; it prints the size and checks the 64 MiB limit, which the
#      working tree's 37 MiB count against).
#   2. With the device tool, once:
#        run(command="bash launch/gpu-check.sh", carry=["gpu-carry.tar.gz"], timeout_s=360)
#      Expected to take 2-4 minutes on an H200 (the coordinator bench writes and loads a 3.75 GB
#      slice: about a minute); every step has its own timeout inside a 330 s
#      budget (GPU_CHECK_BUDGET_S), so even the worst case plus the machine's start (1-2 min)
#      leaves room for one rerun in the 15 minutes of device time. Call give_back after.
#      The results come back under $OUT: gpu-check-<stamp>.txt (everything),
#      gpu-check-summary-<stamp>.txt (one PASS/FAIL/SKIP line per check), gpu-bench-<stamp>.jsonl,
#      gpu-coordinator-bench-<stamp>.jsonl,
#      and each test binary's XML.
#   3. Copy the results file into bench/RESULTS.md with the date and device.
#
# If the carried binaries do not start there (other glibc or libstdc++), the script builds the
# kernel tests and the benchmark from this checkout with nvcc + g++ (launch/gpu-check/, sm_90)
# and the carried GoogleTest source; the backend test needs colibri_core's libraries and is then
# reported as not run.
#
# Exit status: 0 when every check ran and passed, 1 otherwise (the results file says which).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
carry=$root/gpu-carry
# Not here: nccl_transport_test (tests/gpu, the NCCL transport) runs under mpirun and links Open
# MPI, which this GPU machine does not have, and it needs 2+ GPUs (it skips with "needs N GPUs,
# found M" on fewer). Run it on a machine with 2+ GPUs and Open MPI:
#   ctest --test-dir build -R gpu_nccl_transport --output-on-failure
gpu_tests=(expert_ffn_lanes_test expert_ffn_mma_test linear_cuda_test expert_ffn_cuda_test nvfp4_cuda_test
  nvfp4_mma_cuda_test zero_points_cuda_test cuda_expert_backend_test cuda_coordinator_test)
# Need colibri_core's libraries: run only from the carried binaries.
core_tests=(cuda_expert_backend_test cuda_coordinator_test)
binaries=("${gpu_tests[@]}" gpu_expert_bench gpu_coordinator_bench colibri-gen-bench-model)

# ---- staging, on the development machine -------------------------------------------------------
stage() {
  set -e
  local build=${BUILD_DIR:-$root/build}
  if [[ ! -f $build/CMakeCache.txt ]]; then
    cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo
  fi
  grep -q '^COLIBRI_HAVE_CUDA' "$build/CMakeCache.txt" 2>/dev/null || true
  nice cmake --build "$build" -j"${JOBS:-2}" --target "${binaries[@]}"
  rm -rf "$carry"
  mkdir -p "$carry/bin" "$carry/lib" "$carry/lib-cxx"
  local name
  for name in "${binaries[@]}"; do
    local path
    path=$(find "$build" -type f -name "$name" -perm -u+x | head -1)
    [[ -n $path ]] || { echo "gpu-check: $name was not built in $build" >&2; exit 1; }
    cp "$path" "$carry/bin/$name"
    strip "$carry/bin/$name"
  done
  # Shared libraries other than the C library, the driver and cuBLAS: they may be missing there. The C++
  # runtime goes apart (lib-cxx): ours may need a newer glibc than the machine has, so it is
  # used only when the machine's own does not do.
  local lib
  for lib in $(ldd "$carry"/bin/* | awk '/=>/ && $3 ~ /^\// {print $3}' | sort -u); do
    case $(basename "$lib") in
      libc.so* | libm.so* | libpthread.so* | libdl.so* | librt.so* | ld-linux* | libcuda.so*) ;;
      # cuBLAS (570 MB, over the carry limit) comes from the machine's toolkit (lib64 below).
      libcublas.so* | libcublasLt.so*) ;;
      libstdc++.so* | libgcc_s.so*) cp -L "$lib" "$carry/lib-cxx/" ;;
      *) cp -L "$lib" "$carry/lib/" ;;
    esac
  done
  mkdir -p "$carry/googletest"
  cp -r /usr/src/googletest/CMakeLists.txt /usr/src/googletest/googletest "$carry/googletest/"
  rm -rf "$carry/googletest/googletest/docs" "$carry/googletest/googletest/samples" \
    "$carry/googletest/googletest/test"
  {
    echo "staged $(date -u +%FT%TZ) from $(git -C "$root" rev-parse --short HEAD)$(git -C "$root" diff --quiet || echo '+changes') on $(hostname)"
    echo "glibc needed: $(objdump -T "$carry"/bin/* "$carry"/lib/* 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)"
    # CUDA code in each binary (cuobjdump --list-elf where the toolkit has it).
    python3 "$root/tools/list_cuda_archs.py" "$carry"/bin/*
  } >"$carry/MANIFEST"
  cat "$carry/MANIFEST"
  # One compressed file travels (the binaries hold sm_90 and sm_120 code and compress 3x).
  tar -czf "$carry.tar.gz" -C "$root" gpu-carry
  local carry_kib tree_kib
  carry_kib=$(du -k "$carry.tar.gz" | cut -f1)
  tree_kib=$(git -C "$root" ls-files -z --cached --others --exclude-standard | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
  echo "gpu-carry.tar.gz: $((carry_kib / 1024)) MiB; working tree: $((tree_kib / 1024)) MiB; limit 64 MiB together"
  if ((carry_kib + tree_kib > 64 * 1024)); then
    echo "gpu-check: too big to carry" >&2
    exit 1
  fi
}

if [[ ${1-} == --stage ]]; then
  stage
  exit $?
fi
if [[ $# -gt 0 ]]; then
  echo "usage: bash launch/gpu-check.sh [--stage]" >&2
  exit 2
fi

# ---- the check, on the GPU machine -------------------------------------------------------------
started=$SECONDS
stamp=$(date -u +%Y%m%dT%H%M%SZ)
if [[ -n ${OUT-} ]]; then
  results=$OUT
else
  results=$root/bench/gpu-results
fi
mkdir -p "$results"
report=$results/gpu-check-$stamp.txt
summary=$results/gpu-check-summary-$stamp.txt
bench_json=$results/gpu-bench-$stamp.jsonl
: >"$report"
: >"$summary"
failures=0

say() { echo "$*" | tee -a "$report"; }
verdict() {  # verdict PASS|FAIL|SKIP name detail...
  local v=$1
  shift
  echo "$v $*" | tee -a "$summary" | tee -a "$report"
  [[ $v == FAIL ]] && failures=$((failures + 1))
  return 0
}
logs=$(mktemp -d)
budget_s=${GPU_CHECK_BUDGET_S:-330}  # the whole check; each step gets at most what is left
step() {  # step seconds name command...: runs it with a timeout; output in $logs/<name>.log too
  local seconds=$1 name=$2
  shift 2
  local left=$((budget_s - (SECONDS - started)))
  ((seconds > left)) && seconds=$left
  if ((seconds < 5)); then
    say "---- $name: not run, the ${budget_s}s budget is spent"
    echo "not run: the ${budget_s}s budget is spent" >"$logs/$name.log"
    return 124
  fi
  say "---- $name ($(date -u +%T), limit ${seconds}s)"
  timeout --kill-after=5 "$seconds" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  cat "$logs/$name.log" >>"$report"
  say "---- $name: exit $rc after $((SECONDS - started))s total"
  return $rc
}

# The carried binaries arrive as gpu-carry.tar.gz; unpacked afresh on every run.
if [[ -f $carry.tar.gz ]]; then
  rm -rf "$carry"
  tar -xzf "$carry.tar.gz" -C "$root"
fi
say "colibri-node GPU check, $stamp"
say "checkout: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '(no git)')"
[[ -f $carry/MANIFEST ]] && say "carried: $(head -1 "$carry/MANIFEST")"
step 20 "device facts" bash -c '
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,compute_cap --format=csv
  nvidia-smi -L; nvcc --version | tail -2; g++ --version | head -1; cmake --version | head -1
  grep PRETTY_NAME /etc/os-release; ldd --version | head -1; nproc; uname -r
  cuobjdump --list-elf gpu-carry/bin/expert_ffn_cuda_test'
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
[[ -n $gpu_name ]] || verdict FAIL "device: nvidia-smi names no GPU"

# Binaries: the carried ones if they start here, else built from this checkout.
export LD_LIBRARY_PATH=$carry/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
bin=$carry/bin
backend_test=yes
starts() { "$bin/cuda_expert_backend_test" --gtest_list_tests >/dev/null 2>>"$report"; }
if [[ -d $bin ]] && ! starts; then
  say "with this machine's C++ runtime the carried binaries do not start; trying the carried one"
  export LD_LIBRARY_PATH=$carry/lib-cxx:$LD_LIBRARY_PATH
fi
if ! [[ -d $bin ]] || ! starts; then
  say "carried binaries do not start here (see above); building the kernel tests from source"
  build=/tmp/colibri-gpu-check-build
  rm -rf "$build"
  if step 150 "fallback build (nvcc + g++, sm_90)" bash -c "
      cmake -S '$root/launch/gpu-check' -B '$build' -DGTEST_SOURCE_DIR='$carry/googletest' \
        -DCMAKE_CUDA_COMPILER=\$(command -v nvcc || echo /usr/local/cuda/bin/nvcc) &&
      cmake --build '$build' -j\$(nproc)"; then
    bin=$build
    backend_test=no
  else
    verdict FAIL "build: neither the carried binaries nor a build from source run here"
    bin=
  fi
fi

if [[ -n $bin ]]; then
  for t in "${gpu_tests[@]}"; do
    if [[ " ${core_tests[*]} " == *" $t "* && $backend_test == no ]]; then
      verdict FAIL "$t: not run (carried binary does not start here; it needs colibri_core's libraries)"
      continue
    fi
    limit=90
    [[ $t == cuda_expert_backend_test ]] && limit=150
    [[ $t == cuda_coordinator_test ]] && limit=120
    COLIBRI_TEST_DATA=$root/tests/data step $limit "$t" "$bin/$t" \
      --gtest_output="xml:$results/$t-$stamp.xml"
    rc=$?
    log=$logs/$t.log
    summary_line=$(grep -E '^\[  (PASSED|FAILED) +\]' "$log" | head -2 | tr '\n' ' ')
    if ((rc == 124 || rc == 137)); then
      verdict FAIL "$t: timed out after ${limit}s"
    elif grep -q 'error while loading shared libraries' "$log"; then
      verdict FAIL "$t: does not start: $(grep -m1 -o 'error while loading shared libraries.*' "$log")"
    elif ((rc == 0)) && grep -q '^\[  PASSED  \]' "$log" && ! grep -q 'no CUDA device' "$log" &&
      grep -q 'needs compute capability 12.x' "$log"; then
      # nvfp4_mma_cuda_test off Blackwell: the quantizer and the switch's fallback ran, the
      # block-scaled FP4 MMA (compute capability 12.x only) did not.
      verdict PASS "$t: $summary_line"
      verdict SKIP "$t: the MMA tests: $(grep -m1 -o 'needs compute capability 12.x.*' "$log")"
    elif grep -q '^\[  SKIPPED \]' "$log"; then
      verdict FAIL "$t: skipped on the GPU machine: $(grep -m1 -o 'no CUDA device.*' "$log")"
    elif ((rc == 0)) && grep -q '^\[  PASSED  \]' "$log"; then
      verdict PASS "$t: $summary_line"
    else
      verdict FAIL "$t: exit $rc; $summary_line$(grep -E '^\[  FAILED  \] .*\.' "$log" | head -5 | tr '\n' ' ')"
    fi
  done

  step 90 "gpu_expert_bench" bash -c "'$bin/gpu_expert_bench' --batches 1,8,16 --reps 50 | tee '$bench_json.raw'"
  grep '^{' "$bench_json.raw" >"$bench_json" 2>/dev/null
  rm -f "$bench_json.raw"
  if [[ -s $bench_json ]]; then
    python3 - "$bench_json" >>"$summary.tmp" <<'EOF'
import json, sys
lines = list(map(json.loads, open(sys.argv[1])))
rows = {r["batch"]: r for r in lines if r.get("bench") == "gpu_expert_ffn"}
for u in (r for r in lines if r.get("bench") == "gpu_expert_upload"):
    print(("PASS" if u["overlap"] >= 0.5 else "FAIL") +
          f" bench VRAM-tier upload: {u['expert_bytes'] / 1e6:.1f} MB expert up in "
          f"{u['upload_us']:.0f} us ({u['h2d_gbs']:.1f} GB/s: the miss rule's pcie_bytes_per_us = "
          f"{u['pcie_bytes_per_us']:.0f}); with the batch-1 kernels ({u['kernels_us']:.0f} us) "
          f"{u['both_us']:.0f} us, {u['overlap']:.2f} of the shorter hidden (goal >= 0.5)")
b1, b16 = rows.get(1), rows.get(16)
if b1:
    f = b1["fraction_of_copy"]
    print(("PASS" if f >= 0.8 else "FAIL") + f" bench batch 1: {b1['median_us']:.1f} us, "
          f"{b1['weight_gbs']:.0f} GB/s = {f:.3f} of d2d copy {b1['copy_gbs']:.0f} GB/s (goal >= 0.8)")
if b1 and b16:
    r = b16["median_us"] / b1["median_us"]
    print(("PASS" if r <= 2 else "FAIL") + f" bench batch 16 / batch 1 time: {r:.2f} (goal <= 2)")
if b16 and b16.get("cuda_cores_only_us", 0) > 0:
    t, c = b16["median_us"], b16["cuda_cores_only_us"]
    print(("PASS" if t <= c else "FAIL") + f" bench batch 16 on tensor cores {t:.1f} us vs "
          f"CUDA cores only {c:.1f} us (goal: no slower)")
for r in rows.values():
    if not r.get("finite", False):
        print(f"FAIL bench batch {r['batch']}: non-finite output")
EOF
    while read -r line; do verdict $line; done <"$summary.tmp"
    rm -f "$summary.tmp"
  else
    verdict FAIL "bench: no result lines"
  fi
fi

# The coordinator on the GPU: decode step on a GLM-5.2-shaped slice (1 dense + 2 MoE layers, 64
# routed experts int4 on the CPU, vocab 16384), GPU coordinator vs CPU coordinator at context 128,
# and the GPU coordinator alone at context 4096 (past the indexer's top-k 2048) against copy
# bandwidth. Needs the carried binaries (colibri_core). The slice is 3.75 GB, written in ~10 s.
if [[ -n $bin && $backend_test == yes ]]; then
  slice=/tmp/colibri-glm52-slice
  coord_json=$results/gpu-coordinator-bench-$stamp.jsonl
  rm -rf "$slice"
  step 150 "gpu_coordinator_bench" bash -c "
      '$bin/colibri-gen-bench-model' '$slice' --layers 3 --vocab 16384 --experts 64 >/dev/null &&
      OMP_WAIT_POLICY=PASSIVE '$bin/gpu_coordinator_bench' --model '$slice' --context 128 \
        --long-context 4096 --steps 20"
  rc=$?
  rm -rf "$slice"
  grep '^{' "$logs/gpu_coordinator_bench.log" >"$coord_json" 2>/dev/null
  if ((rc == 0)) && [[ -s $coord_json ]]; then
    python3 - "$coord_json" >>"$summary.tmp" <<'EOF2'
import json, sys
r = json.loads(open(sys.argv[1]).readline())
print(("PASS" if r["gpu_step_us"] < r["cpu_step_us"] else "FAIL") +
      f" bench coordinator decode at context {r['context']} (experts on the CPU): GPU "
      f"{r['gpu_step_us']:.0f} us vs CPU {r['cpu_step_us']:.0f} us "
      f"({r['cpu_step_us'] / r['gpu_step_us']:.2f}x; goal: GPU faster)")
print(f"PASS bench GPU coordinator alone at context {r['long_context']}: "
      f"{r['coordinator_alone_us']:.0f} us for >= {r['hbm_bytes'] / 1e6:.0f} MB of HBM = "
      f"{r['hbm_gbs']:.0f} GB/s, {r['fraction_of_copy']:.3f} of d2d copy {r['copy_gbs']:.0f} GB/s")
EOF2
    while read -r line; do verdict $line; done <"$summary.tmp"
    rm -f "$summary.tmp"
  else
    verdict FAIL "bench coordinator: exit $rc, no result line"
  fi
fi

# Out-of-bounds accesses and races in the kernels, where compute-sanitizer works (Firecracker
# machines; not under gVisor): the kernel table test under memcheck, last, in what time is left.
if [[ -n $bin ]]; then
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  if [[ -x $sanitizer ]]; then
    step 120 "compute-sanitizer memcheck" "$sanitizer" --tool memcheck --error-exitcode 3 \
      "$bin/expert_ffn_cuda_test"
    rc=$?
    log=$logs/compute-sanitizer\ memcheck.log
    if ((rc == 0)) && grep -q 'ERROR SUMMARY: 0 errors' "$log"; then
      verdict PASS "compute-sanitizer memcheck of expert_ffn_cuda_test: 0 errors"
    elif ((rc == 3)); then
      verdict FAIL "compute-sanitizer memcheck of expert_ffn_cuda_test: $(grep -m1 'ERROR SUMMARY' "$log")"
    else
      verdict SKIP "compute-sanitizer memcheck: exit $rc ($(tail -n 1 "$log"))"
    fi
  else
    verdict SKIP "compute-sanitizer: not on this machine"
  fi
fi

say ""
say "==== summary ($((SECONDS - started)) s, device: ${gpu_name:-unknown}) ===="
cat "$summary" >>"$report"
cat "$summary"
say "results: $report"
rm -rf "$logs"
((failures == 0))
