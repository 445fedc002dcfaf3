#!/bin/sh
# colibri-gen-bench-model at tiny sizes: writes a 2-layer container (one dense, one MoE layer),
# then colibri-node loads it and decodes 2 tokens. Usage: gen_bench_model_test.sh GEN NODE WORKDIR
set -eu
gen=$1 node=$2 dir=$3/gen-bench-model
rm -rf "$dir"
"$gen" "$dir" --layers 2 --vocab 64 --hidden 256 --heads 4 --q-lora-rank 128 --kv-lora-rank 64 \
  --qk-nope 32 --qk-rope 16 --v-head 32 --index-heads 2 --index-head-dim 32 --index-topk 16 \
  --experts 16 --moe-intermediate 256 --top-k 4 --intermediate 512
for f in config.json generation_config.json model.safetensors.index.json; do
  test -s "$dir/$f" || { echo "missing $dir/$f"; exit 1; }
done
# A second run into the same directory is refused rather than mixing files.
if "$gen" "$dir" --layers 2 --vocab 64 2>/dev/null; then echo "rerun into a full directory was accepted"; exit 1; fi
out=$("$node" --model "$dir" --prompt-ids 1,2,3,4 --ngen 2 --ignore-eos 2>&1) || { echo "$out"; exit 1; }
echo "$out" | grep -q "decode 1 tok" || { echo "$out"; echo "no decode line"; exit 1; }
rm -rf "$dir"
echo ok
