#!/usr/bin/env bash
# batch_bench.sh: aggregate decode tok/s of the batched engine for several numbers of concurrent
# sequences, and the exchange bytes per MoE layer with fp32 and bf16 wires.
#
#   bench/batch_bench.sh MODEL_DIR [colibri-node binary]   (default: build/src/colibri-node)
#
# For each of RUNS rounds (default 3), and in each round for every wire in WIRES (default
# "f32 bf16") and sequence count in SEQS (default "1 4 16 64"), interleaved, runs
#   mpirun -np NP colibri-node --model MODEL_DIR --prompt-ids 1 --ngen NGEN --ignore-eos \
#       --sequences S --wire W --temp TEMP --profile-json ...
# (a one-token prompt, so that every call, the prefill included, has one row a sequence; NP default
# 2, NGEN default 16, TEMP default 1: each sequence samples with its own seed, so the
# sequences route to different experts as distinct requests would; TEMP=0 decodes S copies of one
# greedy sequence, all routed alike) and prints, per (wire, S), the median aggregate decode tok/s
# (decode-only steps: every running sequence's row in one call), and from the profile the bytes
# the coordinator sent and received per MoE-layer exchange, per step and per row, and its
# per-step phase times. The memory read bandwidth is measured in the same run (quant_bench's
# vectorised read, all cores) and turned into two bounds: the step time a pass over the
# coordinator's in-memory weights takes ("weight-pass bound"), and the bytes bound — the weights a
# step must read, the coordinator's plus the routed experts the batch touches (every rank's
# distinct experts per exchange, its tier hits, times the stored bytes of an expert), over the
# read bandwidth; the ratio is the median decode tok/s over the bytes bound. OUT keeps the profiles (default: a temporary directory). Needs python3
# to read the profile JSON and the checkpoint headers.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
model=${1:?usage: batch_bench.sh MODEL_DIR [colibri-node]}
node=${2:-$root/build/src/colibri-node}
runs=${RUNS:-3} np=${NP:-2} ngen=${NGEN:-16} seqs=${SEQS:-1 4 16 64} wires=${WIRES:-f32 bf16} temp=${TEMP:-1}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
export OMP_WAIT_POLICY=PASSIVE
if [[ -n ${OUT:-} ]]; then
  tmp=$OUT
  mkdir -p "$tmp"
else
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
fi
quant_bench=$(dirname "$node")/../bench/quant_bench

cores=$(getconf _NPROCESSORS_ONLN)
echo "batch_bench: $model, np $np, --ngen $ngen --ignore-eos --temp $temp, $runs interleaved rounds"
echo "machine: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1) | $cores cores |" \
     "$(mpirun --version | head -n 1) | load average $(cut -d' ' -f1-3 /proc/loadavg)"

read_gbps=$("$quant_bench" --experts 2 --batch 1 --threads "$cores" --reps 5 --read-mib 1024 |
  sed -n 's/.*"read_gbps":{"median":\([0-9.]*\).*/\1/p' | head -n 1)
echo "memory read bandwidth (quant_bench, $cores threads, median of 5): $read_gbps GB/s"

for ((run = 0; run < runs; ++run)); do
  for wire in $wires; do
    for s in $seqs; do
      out=$tmp/$wire-$s-$run.json
      mpirun --oversubscribe -np "$np" "$node" --model "$model" --prompt-ids 1 --ngen "$ngen" \
        --ignore-eos --sequences "$s" --wire "$wire" --temp "$temp" --quiet --profile-json "$out" >/dev/null 2>"$tmp/log" ||
        { cat "$tmp/log" >&2; echo "batch_bench: run failed (wire $wire, sequences $s)" >&2; exit 1; }
    done
  done
done

python3 - "$tmp" "$runs" "$wires" "$seqs" "$model" "$read_gbps" <<'PY'
import glob, json, os, statistics, struct, sys
tmp, runs, wires, seqs = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split()
model, read_gbps = sys.argv[5], float(sys.argv[6])
# The coordinator's weights in memory, each read once per step: container weights as stored (the
# engine keeps int8/int4 projections quantized; their .qs scales are small and left out) except
# kv_b_proj, which the absorbed attention keeps as fp32; embeddings excepted (a step reads a few
# rows).
coord_bytes = 0
expert_bytes = {}  # (layer, expert): stored bytes of its routed FFN, scales included
for shard in glob.glob(os.path.join(model, "*.safetensors")):
    with open(shard, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    for name, t in header.items():
        if ".mlp.experts." in name:
            parts = name.split(".")
            key = (parts[parts.index("layers") + 1], parts[parts.index("experts") + 1])
            expert_bytes[key] = expert_bytes.get(key, 0) + t["data_offsets"][1] - t["data_offsets"][0]
        if name == "__metadata__" or ".mlp.experts." in name or "embed_tokens" in name or name.endswith(".qs"):
            continue
        numel = 1
        for d in t["shape"]:
            numel *= d
        stored = t["data_offsets"][1] - t["data_offsets"][0]
        coord_bytes += 4 * numel if t["dtype"] != "U8" or "kv_b_proj" in name else stored
pass_ms = coord_bytes / (read_gbps * 1e9) * 1e3
per_expert = sum(expert_bytes.values()) / max(len(expert_bytes), 1)
print(f"coordinator weights in memory: {coord_bytes / 1e9:.2f} GB; one pass at {read_gbps} GB/s: {pass_ms:.1f} ms; "
      f"a routed expert: {per_expert / 1e6:.2f} MB stored")
print(f"\n{'wire':>5} {'seqs':>5} {'decode tok/s (median)':>22} {'all runs':>26} {'bytes/exchange':>15} "
      f"{'bytes/row':>10} {'ms/step attn':>13} {'dense':>7} {'shared':>7} {'lm_head':>8} {'wait':>7} {'experts':>8}")
for wire in wires:
    for s in seqs:
        docs = [json.load(open(f"{tmp}/{wire}-{s}-{r}.json")) for r in range(runs)]
        rates = [d["run"]["decode_tok_per_s"] for d in docs]
        d = docs[-1]
        coord = next(r for r in d["ranks"] if r["role"] == "coordinator")
        exchanges = sum(r["slowest_count"] for r in d["ranks"])
        rows = coord["rows"]
        bytes_ = coord["bytes_in"] + coord["bytes_out"]
        steps = exchanges / max(1, len([l for l in coord["layers"] if "dispatch" in l]))
        ph = coord["phases_us"]
        experts_ms = sum(r["phases_us"].get("compute", 0) for r in d["ranks"] if r["role"] != "coordinator") / 1000 / max(steps, 1)
        ms = lambda k: ph.get(k, 0) / 1000 / max(steps, 1)
        # Distinct experts a step reads: every rank's tier hits (one per expert per exchange).
        hits = statistics.median(sum(r.get(k, 0) for r in doc["ranks"]
                                     for k in ("pinned_hits", "ram_hits", "disk_hits", "vram_hits"))
                                 for doc in docs)
        step_bytes = coord_bytes + hits / max(steps, 1) * per_expert
        bound = int(s) * read_gbps * 1e9 / step_bytes
        print(f"{wire:>5} {s:>5} {statistics.median(rates):>22.2f} {', '.join(f'{x:.2f}' for x in rates):>26} "
              f"{bytes_ / max(exchanges, 1):>15.0f} {bytes_ / max(rows, 1):>10.0f} {ms('attention'):>13.1f} "
              f"{ms('dense_mlp'):>7.1f} {ms('shared_expert'):>7.1f} {ms('lm_head'):>8.1f} {ms('wait_slowest'):>7.1f}"
              f" {experts_ms:>8.1f}"
              f"  (weight-pass bound {int(s) * 1e3 / pass_ms:.1f} tok/s; {hits / max(steps, 1):.1f} distinct experts"
              f" a step, bytes bound {bound:.1f} tok/s, ratio {statistics.median(rates) / bound:.3f})")
        print(json.dumps({"bench": "batch", "wire": wire, "sequences": int(s),
                          "decode_tok_per_s": rates, "bytes_per_exchange": round(bytes_ / max(exchanges, 1)),
                          "bytes_per_row": round(bytes_ / max(rows, 1)), "steps": steps,
                          "distinct_experts_per_step": hits / max(steps, 1), "bytes_bound_tok_per_s": bound,
                          "ratio_to_bytes_bound": statistics.median(rates) / bound}))
PY
