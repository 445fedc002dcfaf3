#!/usr/bin/env bash
# plan_check.sh: `colibri-node plan`'s predicted decode tok/s against measured runs, per config.
#
#   bench/plan_check.sh [MODEL_DIR]        (default: models/glm5-tiny-kjv)
#
# HARDWARE: the description to plan with (default: this machine's calibration,
# ~/.config/colibri-node/hardware.json; run launch/calibrate.sh first). For each config of
# CONFIGS (default below; "np:weights:sequences", weights bf16 = the model as stored, int8 and
# int4 = a colibri-convert copy with those experts and BF16 dense weights, made once in OUT),
# RUNS rounds (default 3), interleaved: one run of
#   launch/colibri-launch --np NP -- --model M --prompt-ids 1,2,3,4 --ngen NGEN --ignore-eos \
#       --sequences S
# and reads the aggregate decode tok/s of its run line; the plan is
#   colibri-node plan --model M --np NP --batches S --context (4 + NGEN / 2) --json
# Prints the machine, a table (predicted, measured median, measured / predicted) and one JSON line
# per config. OUT keeps the converted models (default: a temporary directory, removed).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
model=${1:-$root/models/glm5-tiny-kjv}
node=${COLIBRI_NODE:-$root/build/src/colibri-node}
convert=${COLIBRI_CONVERT:-$root/build/src/colibri-convert}
runs=${RUNS:-3} ngen=${NGEN:-128}
configs=${CONFIGS:-"2:bf16:1 3:bf16:1 4:bf16:1 7:bf16:1 3:int8:1 3:int4:1 3:bf16:4 3:bf16:16 2:int4:16"}
hardware=()
[[ -n ${HARDWARE:-} ]] && hardware=(--hardware "$HARDWARE")
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_WAIT_POLICY=PASSIVE
if [[ -n ${OUT:-} ]]; then
  tmp=$OUT
  mkdir -p "$tmp"
else
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
fi
[[ -x $node ]] || { echo "plan_check: $node is not an executable (build first)" >&2; exit 2; }

model_for() {  # model_for WEIGHTS: the directory to run with those routed experts
  case $1 in
    bf16) echo "$model" ;;
    int8 | int4)
      local dir=$tmp/model-$1
      if [[ ! -f $dir/config.json ]]; then
        "$convert" --expert-bits "${1#int}" --dense-bits 16 --io-bits 16 "$model" "$dir" \
          >"$tmp/convert.log" 2>&1 || { cat "$tmp/convert.log" >&2; exit 1; }
      fi
      echo "$dir"
      ;;
    *) echo "plan_check: weights '$1': expected bf16, int8 or int4" >&2; exit 2 ;;
  esac
}

echo "plan_check: predicted (colibri-node plan) vs measured decode tok/s, $(basename "$model"), --ngen $ngen, $runs runs"
echo "machine: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1) | $(getconf _NPROCESSORS_ONLN) cores |" \
  "load average $(cut -d' ' -f1-3 /proc/loadavg)"

declare -A predicted measured coordinator experts
for config in $configs; do
  IFS=: read -r np weights seqs <<<"$config"
  dir=$(model_for "$weights")
  plan=$("$node" plan --model "$dir" "${hardware[@]}" --np "$np" --batches "$seqs" \
    --context $((4 + ngen / 2)) --prompt-tokens 4 --json)
  read -r predicted[$config] coordinator[$config] experts[$config] < <(python3 -c '
import json, sys
p = json.loads(sys.argv[1]); s = sys.argv[2]
print(p["decode_tok_s"][s], p["step_s"][s]["coordinator"] * 1e3, p["step_s"][s]["experts"] * 1e3)' "$plan" "$seqs")
done
for ((round = 0; round < runs; ++round)); do
  for config in $configs; do
    IFS=: read -r np weights seqs <<<"$config"
    dir=$(model_for "$weights")
    log=$("$root/launch/colibri-launch" --np "$np" -- --model "$dir" --prompt-ids 1,2,3,4 \
      --ngen "$ngen" --ignore-eos --sequences "$seqs" 2>&1 >/dev/null) ||
      { echo "$log" >&2; echo "plan_check: $config failed" >&2; exit 1; }
    rate=$(sed -n 's/.*decode [0-9]* tok in [0-9.]* s (\([0-9.]*\) tok\/s).*/\1/p' <<<"$log")
    [[ -n $rate ]] || { echo "$log" >&2; echo "plan_check: no run line for $config" >&2; exit 1; }
    measured[$config]="${measured[$config]:-} $rate"
  done
done

printf '\n%4s  %-7s  %4s  %12s  %22s  %12s  %9s\n' np weights rows "plan tok/s" "plan step ms (coord+exp)" "measured" "meas/plan"
for config in $configs; do
  IFS=: read -r np weights seqs <<<"$config"
  median=$(tr ' ' '\n' <<<"${measured[$config]}" | sed '/^$/d' | sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}')
  ratio=$(awk -v m="$median" -v p="${predicted[$config]}" 'BEGIN {printf "%.2f", m / p}')
  printf '%4s  %-7s  %4s  %12.1f  %10.3f + %9.3f  %12.1f  %9s\n' "$np" "$weights" "$seqs" "${predicted[$config]}" \
    "${coordinator[$config]}" "${experts[$config]}" "$median" "$ratio"
  printf '{"bench":"plan_check","np":%s,"weights":"%s","rows":%s,"plan_tok_s":%.2f,"measured_tok_s":%s,"runs":[%s],"ratio":%s}\n' \
    "$np" "$weights" "$seqs" "${predicted[$config]}" "$median" "$(sed 's/^ //; s/ /,/g' <<<"${measured[$config]}")" "$ratio" >>"$tmp/lines"
done
cat "$tmp/lines"
