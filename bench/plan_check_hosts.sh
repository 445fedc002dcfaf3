#!/usr/bin/env bash
# plan_check_hosts.sh: `colibri-node plan` against a measured run across three namespace hosts
# (launch/netns-hosts.sh; root) joined by a rate-limited link.
#
#   bench/plan_check_hosts.sh            LINK (default 10g), RUNS (default 3), NGEN (default 128)
#
# Makes the set NAME (default plancheck: NAME-head + NAME-h1, NAME-h2), shapes the link, measures
# the exchange between the head and host 1 with `mpirun -np 2 colibri-node calibrate --exchange`
# into a copy of this machine's calibration (HARDWARE, default ~/.config/colibri-node/
# hardware.json), describes the three hosts with that machine's sockets and the measured link,
# plans the layout (coordinator on the head, one cpu-expert rank on each host) and runs it RUNS
# times on the embedded model (--ngen NGEN --ignore-eos, one row). Prints the plan's and the
# measured tok/s, one JSON line, and takes the set down (also on failure).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
node=${COLIBRI_NODE:-$root/build/src/colibri-node}
name=${NAME:-plancheck}
link=${LINK:-10g} runs=${RUNS:-3} ngen=${NGEN:-128}
hardware=${HARDWARE:-${XDG_CONFIG_HOME:-$HOME/.config}/colibri-node/hardware.json}
model=$root/models/glm5-tiny-kjv
[[ -f $hardware ]] || { echo "plan_check_hosts: no calibration at $hardware (launch/calibrate.sh)" >&2; exit 2; }
tmp=$(mktemp -d)
cleanup() {
  "$root/launch/netns-hosts.sh" down --name "$name" >/dev/null 2>&1 || true
  rm -rf "$tmp"
}
trap cleanup EXIT
rc=0
"$root/launch/netns-hosts.sh" up 2 --name "$name" --head-slots 1 --slots 1 >"$tmp/up.log" 2>&1 || rc=$?
if ((rc == 77)); then
  echo "plan_check_hosts: skipped: $(tail -n 1 "$tmp/up.log")"
  exit 0
fi
((rc == 0)) || { cat "$tmp/up.log" >&2; exit 1; }
"$root/launch/netns-hosts.sh" link "$link" --name "$name" >"$tmp/link.log" 2>&1
state=${COLIBRI_NETNS_DIR:-/run/colibri-netns/$name}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_WAIT_POLICY=PASSIVE

cp "$hardware" "$tmp/calibration.json"
"$state/mpirun" -np 2 "$node" calibrate --exchange --hidden 256 --out "$tmp/calibration.json" \
  >"$tmp/exchange.log" 2>&1 || { cat "$tmp/exchange.log" >&2; exit 1; }
python3 - "$tmp/calibration.json" "$name" >"$tmp/hosts.json" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
name = sys.argv[2]
host = doc["hosts"][0]
hosts = []
for h in [name + "-head", name + "-h1", name + "-h2"]:
    copy = dict(host)
    copy["name"] = h
    hosts.append(copy)
print(json.dumps({"hosts": hosts, "links": doc["links"]}))
EOF
printf '0 coordinator - - - - %s-head\n1 cpu-expert - - - - %s-h1\n2 cpu-expert - - - - %s-h2\n' \
  "$name" "$name" "$name" >"$tmp/layout"
plan=$("$node" plan --model "$model" --hardware "$tmp/hosts.json" --layout "$tmp/layout" \
  --batches 1 --context $((4 + ngen / 2)) --prompt-tokens 4 --json)
predicted=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["decode_tok_s"]["1"])' "$plan")
rates=()
for ((i = 0; i < runs; ++i)); do
  log=$("$state/mpirun" -np 3 "$node" --layout "$tmp/layout" --model "$model" --prompt-ids 1,2,3,4 \
    --ngen "$ngen" --ignore-eos 2>&1 >/dev/null) || { echo "$log" >&2; exit 1; }
  rates+=("$(sed -n 's/.*decode [0-9]* tok in [0-9.]* s (\([0-9.]*\) tok\/s).*/\1/p' <<<"$log")")
done
median=$(printf '%s\n' "${rates[@]}" | sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}')
echo "plan_check_hosts: 3 namespace hosts, link $link: $(tail -n 1 "$tmp/link.log")"
grep "exchange fit" "$tmp/exchange.log" || true
printf 'plan %.1f tok/s, measured %s tok/s (runs: %s), measured / plan %.2f\n' "$predicted" "$median" \
  "${rates[*]}" "$(awk -v m="$median" -v p="$predicted" 'BEGIN {print m / p}')"
printf '{"bench":"plan_check_hosts","link":"%s","np":3,"plan_tok_s":%.2f,"measured_tok_s":%s,"runs":[%s]}\n' \
  "$link" "$predicted" "$median" "$(IFS=,; echo "${rates[*]}")"
