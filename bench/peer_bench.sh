#!/usr/bin/env bash
# peer_bench.sh: colibri-node against llama.cpp on the CPU, same GLM-5-architecture checkpoint,
# same formats (routed experts 4-bit, everything else 8-bit), same thread counts, interleaved.
#
#   bench/peer_bench.sh [setup|run|all]      (default: all)
#
# setup (each step skipped when its output exists under $PEER_WORK, default /tmp/colibri-peer):
#   1. a Python venv with torch + transformers (PyPI) for the checkpoint and llama.cpp's converter;
#   2. llama.cpp from its published source package: the llama-cpp-python sdist on PyPI
#      (LLAMA_CPP_PYTHON_VERSION, default 0.3.36), whose vendor/llama.cpp is built with CMake
#      (CPU only, -DGGML_NATIVE=ON); nothing of it is kept in this repository;
#   3. tools/make_peer_checkpoint.py: random GLM-5 weights, hidden 2048, 8 layers, 32 experts of
#      1408, top-8, MLA + DSA, 2.2 B parameters, BF16;
#   4. colibri-convert (int4 g64 experts, int8 rest) and llama.cpp's convert_hf_to_gguf.py (BF16)
#      then llama-quantize (Q8_0, routed experts Q4_0).
# run: ROUNDS (default 3) rounds; in each, for every thread count in THREADS (default "1 2"):
#   llama-bench tg64 and pp128; colibri-node decode of 64 tokens from an empty context (one
#   prompt token, greedy, --ignore-eos: llama-bench's tg64 starts at depth 0 too) and a 128-token
#   prefill; and the memory read bandwidth (quant_bench's read loop, right before and right after
#   colibri's decode, their mean). Medians per engine and thread count, the ratios, and the median
#   over rounds of colibri's decode weight bytes per token / time against that round's read
#   bandwidth. The machine's load average is printed with every round.
#   DEPTH=N (default 0: not measured) adds decode at depth: llama-bench tg32 after N context
#   tokens (-d N) against colibri-node's decode of 32 tokens after an N-token prompt; and prefill
#   at depth: llama-bench pp128 after D = N rounded down to a multiple of 128 (at least 128)
#   context tokens against colibri-node's last 128-row chunk of a (D + 128)-token prompt, timed
#   from its --trace (the chunk's embedding to its lm_head).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build}
work=${PEER_WORK:-/tmp/colibri-peer}
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
rounds=${ROUNDS:-3}
threads_list=${THREADS:-1 2}
depth=${DEPTH:-0}
stage=${1:-all}
node=$build/src/colibri-node
convert=$build/src/colibri-convert
quant_bench=$build/bench/quant_bench
hf=$work/glm5-2b-hf
ours=$work/glm5-2b-colibri
gguf_bf16=$work/glm5-2b-bf16.gguf
gguf=$work/glm5-2b-q4_0-experts-q8_0.gguf
llama=$work/llama.cpp
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

say() { echo "peer_bench: $*" >&2; }
for bin in "$node" "$convert" "$quant_bench"; do
  [[ -x $bin ]] || { say "$bin missing (build colibri-node first; BUILD_DIR=$build)"; exit 2; }
done
mkdir -p "$work"

setup() {
  if [[ ! -x $work/venv/bin/python ]] || ! "$work/venv/bin/python" -c 'import torch, transformers' 2>/dev/null; then
    say "venv: torch, transformers, safetensors (PyPI)"
    python3 -m venv "$work/venv"
    "$work/venv/bin/pip" install -q --upgrade pip
    "$work/venv/bin/pip" install -q torch transformers safetensors numpy sentencepiece protobuf
  fi
  if [[ ! -x $llama/build/bin/llama-bench ]]; then
    say "llama.cpp: llama-cpp-python==$version sdist from PyPI, vendor/llama.cpp"
    rm -rf "$work/sdist" && mkdir -p "$work/sdist"
    "$work/venv/bin/pip" download -q --no-binary :all: --no-deps -d "$work/sdist" "llama-cpp-python==$version"
    tar -xzf "$work"/sdist/llama_cpp_python-"$version".tar.gz -C "$work/sdist"
    rm -rf "$llama" && mv "$work/sdist/llama_cpp_python-$version/vendor/llama.cpp" "$llama"
    cmake -S "$llama" -B "$llama/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF > "$work/llama-cmake.log"
    nice cmake --build "$llama/build" -j "$(getconf _NPROCESSORS_ONLN)" \
      --target llama-bench llama-quantize > "$work/llama-build.log"
  fi
  if [[ ! -f $hf/model.safetensors.index.json ]]; then
    say "checkpoint: $hf"
    "$work/venv/bin/python" "$root/tools/make_peer_checkpoint.py" "$hf"
  fi
  if [[ ! -f $ours/config.json ]]; then
    say "colibri-convert: $ours"
    "$convert" "$hf" "$ours" --expert-bits 4 --group-size 64 --dense-bits 8 --io-bits 8 >&2
  fi
  if [[ ! -f $gguf ]]; then
    say "convert_hf_to_gguf.py + llama-quantize: $gguf"
    # The checkpoint's tokenizer (trained BPE, not a released model's) has no entry in the
    # converter's pre-tokenizer table; the benchmarks feed token ids, so any BPE pre-tokenizer
    # does: name one at conversion time.
    PYTHONPATH="$llama/gguf-py:$llama" "$work/venv/bin/python" - "$hf" "$gguf_bf16" <<'PY'
import sys
sys.argv = ["convert_hf_to_gguf.py", sys.argv[1], "--outtype", "bf16", "--outfile", sys.argv[2]]
import convert_hf_to_gguf as c
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
c.main()
PY
    "$llama/build/bin/llama-quantize" --tensor-type 'ffn_(gate|up|down)_exps=q4_0' \
      "$gguf_bf16" "$gguf" q8_0 > "$work/quantize.log" 2>&1
  fi
}

# read_gbps THREADS: the median GB/s of quant_bench's read loop over a 1-GiB buffer, 5 reps.
read_gbps() {
  "$quant_bench" --experts 2 --batch 1 --threads "$1" --activations int8 --reps 5 --read-mib 1024 \
    2>/dev/null | sed -n 's/.*"read_gbps":{"median":\([0-9.]*\).*/\1/p' | head -n 1
}
median() { sort -g | awk '{v[NR]=$1} END {if (NR == 0) print "nan"; else if (NR % 2) print v[(NR+1)/2]; else print (v[NR/2]+v[NR/2+1])/2}'; }

# at_depth TITLE LLAMA_HEADING COLIBRI_HEADING COLUMN BENCH DEPTH LLAMA_KEY COLIBRI_KEY: the medians
# of results.tsv's columns COLUMN (llama.cpp) and COLUMN + 1 (colibri-node) per thread count, their
# ratio, and a JSON line each.
at_depth() {
  local title=$1 llama_heading=$2 colibri_heading=$3 column=$4 bench=$5 at=$6 llama_key=$7 colibri_key=$8
  echo
  echo "$title: medians over $rounds rounds (tok/s)"
  printf '%7s  %14s %14s %6s\n' threads "$llama_heading" "$colibri_heading" ratio
  for t in $threads_list; do
    local a b
    a=$(awk -F'\t' -v t="$t" -v c="$column" '$2 == t {print $c}' "$work/results.tsv" | median)
    b=$(awk -F'\t' -v t="$t" -v c="$((column + 1))" '$2 == t {print $c}' "$work/results.tsv" | median)
    awk -v t="$t" -v a="$a" -v b="$b" 'BEGIN {printf "%7s  %14.2f %14.2f %6.2f\n", t, a, b, b / a}'
    printf '{"bench":"%s","threads":%s,"depth":%s,"%s":%s,"%s":%s,"rounds":%s}\n' \
      "$bench" "$t" "$at" "$llama_key" "$a" "$colibri_key" "$b" "$rounds"
  done
}

run() {
  [[ -f $gguf && -f $ours/config.json ]] || { say "run setup first"; exit 2; }
  local prompt
  prompt=$(seq 11 138 | paste -sd, -)  # 128 token ids
  local deep_prompt prefill_depth prefill_prompt
  deep_prompt=$(seq 0 $((depth - 1)) | awk '{print 11 + $1 % 4000}' | paste -sd, -)  # DEPTH ids
  prefill_depth=$((depth / 128 * 128))
  ((prefill_depth >= 128)) || prefill_depth=128
  prefill_prompt=$(seq 0 $((prefill_depth + 127)) | awk '{print 11 + $1 % 4000}' | paste -sd, -)
  local cores
  cores=$(getconf _NPROCESSORS_ONLN)
  echo "peer_bench: colibri-node $(git -C "$root" rev-parse --short HEAD 2>/dev/null) vs llama.cpp (vendored in the llama-cpp-python $version sdist)"
  echo "machine: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1) | $cores cores | $(uname -r)"
  echo "model: GLM-5 architecture, 2.2 B parameters, random weights; colibri int4-g64 experts + int8 rest; llama.cpp Q4_0 experts + Q8_0 rest"
  local results=$work/results.tsv
  : > "$results"
  for ((r = 1; r <= rounds; ++r)); do
    echo "round $r/$rounds: load average $(cut -d' ' -f1-3 /proc/loadavg)"
    for t in $threads_list; do
      local out tg pp line dec pre bw
      out=$("$llama/build/bin/llama-bench" -m "$gguf" -t "$t" -p 128 -n 64 -r 1 -o csv 2>/dev/null)
      pp=$(awk -F, 'NR > 1 && $0 ~ /"128","0"/ {gsub(/"/, "", $0); print}' <<<"$out" | awk -F, '{print $(NF-1)}' | head -n 1)
      tg=$(awk -F, 'NR > 1 && $0 ~ /"0","64"/ {gsub(/"/, "", $0); print}' <<<"$out" | awk -F, '{print $(NF-1)}' | head -n 1)
      # As llama-bench: decode from an empty context (one prompt token), prefill of 128 tokens.
      # The read bandwidth is taken on both sides of the decode, so that both see the same machine.
      local bw_before bw_after
      bw_before=$(read_gbps "$t")
      line=$(OMP_NUM_THREADS=$t "$node" --model "$ours" --prompt-ids 11 --ngen 65 --ignore-eos \
               2>&1 >/dev/null | grep -E 'prefill [0-9]+ tok' | tail -n 1)
      bw_after=$(read_gbps "$t")
      bw=$(awk -v a="$bw_before" -v b="$bw_after" 'BEGIN {
             if (a == "" || b == "") print (a == "" ? (b == "" ? "nan" : b) : a)
             else printf "%.3f", (a + b) / 2 }')
      dec=$(sed -n 's/.*decode [0-9]* tok in [0-9.]* s (\([0-9.]*\) tok\/s).*/\1/p' <<<"$line")
      line=$(OMP_NUM_THREADS=$t "$node" --model "$ours" --prompt-ids "$prompt" --ngen 1 \
               --max-rows 128 2>&1 >/dev/null | grep -E 'prefill [0-9]+ tok' | tail -n 1)
      pre=$(sed -n 's/.*prefill \([0-9]*\) tok in \([0-9.]*\) s.*/\1 \2/p' <<<"$line" | awk '{printf "%.2f", $1 / $2}')
      local tgd=nan decd=nan ppd=nan pred=nan
      if ((depth > 0)); then
        tgd=$("$llama/build/bin/llama-bench" -m "$gguf" -t "$t" -p 0 -n 32 -d "$depth" -r 1 -o csv 2>/dev/null |
                awk -F, 'NR > 1 {gsub(/"/, "", $0); print $(NF-1)}' | head -n 1)
        line=$(OMP_NUM_THREADS=$t "$node" --model "$ours" --prompt-ids "$deep_prompt" \
                 --ngen 33 --ignore-eos --max-rows 128 2>&1 >/dev/null | grep -E 'prefill [0-9]+ tok' | tail -n 1)
        decd=$(sed -n 's/.*decode [0-9]* tok in [0-9.]* s (\([0-9.]*\) tok\/s).*/\1/p' <<<"$line")
        ppd=$("$llama/build/bin/llama-bench" -m "$gguf" -t "$t" -p 128 -n 0 -d "$prefill_depth" -r 1 -o csv 2>/dev/null |
                awk -F, 'NR > 1 {gsub(/"/, "", $0); print $(NF-1)}' | head -n 1)
        rm -f "$work/prefill_trace.json"
        OMP_NUM_THREADS=$t "$node" --model "$ours" --prompt-ids "$prefill_prompt" --ngen 1 \
          --max-rows 128 --trace "$work/prefill_trace.json" >/dev/null 2>&1 ||
          say "round $r, $t threads: colibri-node's prefill at depth failed (prefill at depth: nan)"
        pred=$("$work/venv/bin/python" - "$work/prefill_trace.json" <<'PY'
import json, os, sys
if not os.path.exists(sys.argv[1]):
    print("nan")
    sys.exit()
events = json.load(open(sys.argv[1]))
events = events["traceEvents"] if isinstance(events, dict) else events
start = max(e["ts"] for e in events if e.get("name") == "embed" and e.get("pid") == 0)
end = max(e["ts"] + e["dur"] for e in events if e.get("name") == "lm_head" and e.get("pid") == 0)
print(f"{128 / ((end - start) / 1e6):.2f}")
PY
)
      fi
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$r" "$t" "$tg" "$pp" "$dec" "$pre" "$bw" "$tgd" "$decd" "$ppd" "$pred" |
        tee -a "$results" >&2
    done
  done
  # Decode weight bytes per token: every tensor but the routed experts and the embeddings, plus
  # top_k / n_experts of the routed experts (uniform routing on random weights), plus one
  # embedding row.
  local bytes
  bytes=$("$work/venv/bin/python" - "$ours" <<'PY'
import json, struct, sys
from pathlib import Path
d = Path(sys.argv[1]); cfg = json.loads((d / "config.json").read_text())
dense = experts = embed = 0
for f in d.glob("*.safetensors"):
    with open(f, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]; h = json.loads(fh.read(n))
    for k, v in h.items():
        if k == "__metadata__": continue
        b = v["data_offsets"][1] - v["data_offsets"][0]
        if ".mlp.experts." in k: experts += b
        elif "embed_tokens" in k: embed += b
        else: dense += b
print(int(dense + experts * cfg["num_experts_per_tok"] / cfg["n_routed_experts"] + embed / cfg["vocab_size"]))
PY
)
  echo
  echo "medians over $rounds rounds (tok/s); colibri decode bytes per token $(awk -v b="$bytes" 'BEGIN{printf "%.1f MB", b/1e6}')"
  printf '%7s  %12s %12s %6s  %12s %12s %6s  %9s %9s\n' threads "llama tg64" "colibri tg" ratio "llama pp128" "colibri pp" ratio "read GB/s" "tg/read"
  for t in $threads_list; do
    local tg dec pp pre bw tg_read
    tg=$(awk -F'\t' -v t="$t" '$2 == t {print $3}' "$results" | median)
    pp=$(awk -F'\t' -v t="$t" '$2 == t {print $4}' "$results" | median)
    dec=$(awk -F'\t' -v t="$t" '$2 == t {print $5}' "$results" | median)
    pre=$(awk -F'\t' -v t="$t" '$2 == t {print $6}' "$results" | median)
    bw=$(awk -F'\t' -v t="$t" '$2 == t {print $7}' "$results" | median)
    # Each round's decode against that round's read bandwidth, then the median over rounds.
    tg_read=$(awk -F'\t' -v t="$t" -v b="$bytes" '$2 == t && $5 + 0 > 0 && $7 + 0 > 0 {print $5 * b / 1e9 / $7}' "$results" | median)
    awk -v t="$t" -v tg="$tg" -v dec="$dec" -v pp="$pp" -v pre="$pre" -v bw="$bw" -v r="$tg_read" 'BEGIN {
      printf "%7s  %12.2f %12.2f %6.2f  %12.2f %12.2f %6.2f  %9.2f %9.2f\n", t, tg, dec, dec / tg, pp, pre, pre / pp, bw, r }'
    printf '{"bench":"peer","threads":%s,"llama_tg":%s,"colibri_tg":%s,"llama_pp":%s,"colibri_pp":%s,"read_gbps":%s,"decode_bytes_per_token":%s,"tg_bytes_over_read":%s,"rounds":%s}\n' \
      "$t" "$tg" "$dec" "$pp" "$pre" "$bw" "$bytes" "$tg_read" "$rounds"
  done
  ((depth > 0)) || return 0
  at_depth "decode at depth $depth" "llama tg32@d" "colibri tg@d" 8 peer_depth "$depth" llama_tg colibri_tg
  at_depth "prefill of 128 tokens at depth $prefill_depth" "llama pp128@d" "colibri pp@d" 10 \
    peer_prefill_depth "$prefill_depth" llama_pp colibri_pp
}

case $stage in
  setup) setup ;;
  run) run ;;
  all) setup; run ;;
  *) say "unknown stage '$stage' (setup, run or all)"; exit 2 ;;
esac
