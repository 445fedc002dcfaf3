#!/usr/bin/env bash
# plan_check.sh: `colibri-node plan`'s predicted decode tok/s against measured runs, per config.
#
#   bench/plan_check.sh
#
# HARDWARE: the description to plan with (default: this machine's calibration,
# ~/.config/colibri-node/hardware.json; run launch/calibrate.sh first). A config is
# "np:model:rows[:flags]": model bf16 is models/glm5-tiny-kjv as stored, int8 and int4 a
# colibri-convert copy of it with those experts and BF16 dense weights, slice the GLM-5.2-shaped
# slice of colibri-gen-bench-model (int4 experts, int8 dense; made once in SLICE, default
# /tmp/glm52-slice); rows the sequences decoded together (--sequences); flags extra colibri-node
# flags, '+' for a space (e.g. --wire+bf16), given to the plan too where it knows them (--wire,
# --ram-gb). CONFIGS (default below) are run RUNS rounds (default 3), interleaved, each one job
#   launch/colibri-launch --np NP -- --model M --prompt-ids 1,2,..,P --ngen NGEN --ignore-eos \
#       --sequences ROWS FLAGS
# (P: PROMPT_TOKENS 200, SLICE_PROMPT_TOKENS 32; NGEN 128, SLICE_NGEN 16), reading the aggregate
# decode tok/s and the TTFT of its run line; the plan is `colibri-node plan --model M --np NP
# --batches ROWS --context (P + NGEN / 2) --prompt-tokens P --json`.
# Prints the machine, a table (predicted, measured median, measured / predicted) and one JSON
# line per config. OUT keeps the converted models (default: a temporary directory, removed).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tiny=$root/models/glm5-tiny-kjv
slice=${SLICE:-/tmp/glm52-slice}
node=${COLIBRI_NODE:-$root/build/src/colibri-node}
convert=${COLIBRI_CONVERT:-$root/build/src/colibri-convert}
gen=${COLIBRI_GEN:-$root/build/src/colibri-gen-bench-model}
runs=${RUNS:-3} ngen_tiny=${NGEN:-128} ngen_slice=${SLICE_NGEN:-16}
prompt_tiny=${PROMPT_TOKENS:-200} prompt_slice=${SLICE_PROMPT_TOKENS:-32}
configs=${CONFIGS:-"1:bf16:1 3:bf16:1 7:bf16:1 1:bf16:16 3:bf16:16 3:int4:1 3:bf16:1:--wire+bf16 3:bf16:1:--ram-gb+0.002 1:slice:1 2:slice:1 2:slice:1:--split-linears"}
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

model_for() {  # model_for MODEL: the directory
  case $1 in
    bf16) echo "$tiny" ;;
    int8 | int4)
      local dir=$tmp/model-$1
      if [[ ! -f $dir/config.json ]]; then
        "$convert" --expert-bits "${1#int}" --dense-bits 16 --io-bits 16 "$tiny" "$dir" \
          >"$tmp/convert.log" 2>&1 || { cat "$tmp/convert.log" >&2; exit 1; }
      fi
      echo "$dir"
      ;;
    slice)
      [[ -f $slice/config.json ]] || "$gen" "$slice" >"$tmp/gen.log" 2>&1 ||
        { cat "$tmp/gen.log" >&2; exit 1; }
      echo "$slice"
      ;;
    *) echo "plan_check: model '$1': expected bf16, int8, int4 or slice" >&2; exit 2 ;;
  esac
}
ngen_for() { if [[ $1 == slice ]]; then echo "$ngen_slice"; else echo "$ngen_tiny"; fi; }
prompt_for() {  # prompt_for MODEL: token ids 1..P, as --prompt-ids
  local p=$prompt_tiny
  [[ $1 == slice ]] && p=$prompt_slice
  seq -s, 1 "$p"
}
plan_flags() {  # plan_flags FLAGS...: those the plan takes
  local out=()
  while (($#)); do
    case $1 in
      --wire | --ram-gb) out+=("$1" "$2"); shift 2 ;;
      *) shift ;;
    esac
  done
  echo "${out[*]}"
}

echo "plan_check: predicted (colibri-node plan) vs measured decode tok/s, $runs runs"
echo "machine: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1) | $(getconf _NPROCESSORS_ONLN) cores |" \
  "load average $(cut -d' ' -f1-3 /proc/loadavg)"

declare -A predicted measured coordinator experts ttft_plan ttft
for config in $configs; do
  IFS=: read -r np model rows flags <<<"$config"
  dir=$(model_for "$model")
  ngen=$(ngen_for "$model")
  read -ra extra <<<"${flags//+/ }"
  read -ra for_plan <<<"$(plan_flags "${extra[@]}")"
  prompt_tokens=$(prompt_for "$model" | tr ',' '\n' | wc -l)
  plan=$("$node" plan --model "$dir" "${hardware[@]}" --np "$np" --batches "$rows" \
    --context $((prompt_tokens + ngen / 2)) --prompt-tokens "$prompt_tokens" "${for_plan[@]}" --json)
  read -r predicted[$config] coordinator[$config] experts[$config] ttft_plan[$config] < <(python3 -c '
import json, sys
p = json.loads(sys.argv[1]); s = sys.argv[2]
print(p["decode_tok_s"][s], p["step_s"][s]["coordinator"] * 1e3, p["step_s"][s]["experts"] * 1e3,
      p["ttft_s"])' "$plan" "$rows")
done
for ((round = 0; round < runs; ++round)); do
  for config in $configs; do
    IFS=: read -r np model rows flags <<<"$config"
    dir=$(model_for "$model")
    read -ra extra <<<"${flags//+/ }"
    log=$("$root/launch/colibri-launch" --np "$np" -- --model "$dir" --prompt-ids "$(prompt_for "$model")" \
      --ngen "$(ngen_for "$model")" --ignore-eos --sequences "$rows" "${extra[@]}" 2>&1 >/dev/null) ||
      { echo "$log" >&2; echo "plan_check: $config failed" >&2; exit 1; }
    rate=$(sed -n 's/.*decode [0-9]* tok in [0-9.]* s (\([0-9.]*\) tok\/s).*/\1/p' <<<"$log")
    [[ -n $rate ]] || { echo "$log" >&2; echo "plan_check: no run line for $config" >&2; exit 1; }
    measured[$config]="${measured[$config]:-} $rate"
    ttft[$config]="${ttft[$config]:-} $(sed -n 's/.*| TTFT \([0-9.]*\) s.*/\1/p' <<<"$log")"
  done
done

median_of() { tr ' ' '\n' <<<"$1" | sed '/^$/d' | sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }
printf '\n%4s  %-6s  %4s  %-16s  %11s  %24s  %10s  %9s  %10s  %10s  %9s\n' np model rows flags "plan tok/s" \
  "plan step ms (coord+exp)" measured "meas/plan" "plan TTFT" "TTFT s" "meas/plan"
for config in $configs; do
  IFS=: read -r np model rows flags <<<"$config"
  median=$(median_of "${measured[$config]}")
  ttft_median=$(median_of "${ttft[$config]}")
  ratio=$(awk -v m="$median" -v p="${predicted[$config]}" 'BEGIN {printf "%.2f", m / p}')
  ttft_ratio=$(awk -v m="$ttft_median" -v p="${ttft_plan[$config]}" 'BEGIN {printf "%.2f", m / p}')
  printf '%4s  %-6s  %4s  %-16s  %11.1f  %11.3f + %10.3f  %10.1f  %9s  %10.4f  %10.4f  %9s\n' "$np" "$model" \
    "$rows" "${flags//+/ }" "${predicted[$config]}" "${coordinator[$config]}" "${experts[$config]}" "$median" \
    "$ratio" "${ttft_plan[$config]}" "$ttft_median" "$ttft_ratio"
  printf '{"bench":"plan_check","np":%s,"model":"%s","rows":%s,"flags":"%s","plan_tok_s":%.2f,"measured_tok_s":%s,"runs":[%s],"ratio":%s,"plan_ttft_s":%.5f,"ttft_s":%s,"ttft_ratio":%s}\n' \
    "$np" "$model" "$rows" "${flags//+/ }" "${predicted[$config]}" "$median" \
    "$(sed 's/^ //; s/ /,/g' <<<"${measured[$config]}")" "$ratio" "${ttft_plan[$config]}" "$ttft_median" \
    "$ttft_ratio" >>"$tmp/lines"
done
cat "$tmp/lines"
