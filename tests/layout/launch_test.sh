#!/usr/bin/env bash
# launch/colibri-launch: --dry-run for every committed hostfile/layout pair, option handling and
# errors, and one real mpirun of a layout with a stand-in for colibri-node that reports what each
# rank was given. Usage: launch_test.sh REPO_ROOT
set -euo pipefail

root=$(cd "${1:?usage: launch_test.sh REPO_ROOT}" && pwd)
launch=$root/launch/colibri-launch
hf=$root/hostfiles
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

failures=0
check() {  # check DESCRIPTION CONDITION...
  local what=$1
  shift
  if "$@"; then
    echo "ok    $what"
  else
    echo "FAIL  $what"
    failures=$((failures + 1))
  fi
}
has() { [[ $out == *"$1"* ]]; }
lacks() { [[ $out != *"$1"* ]]; }
count() { grep -oF -- "$1" <<<"$out" | wc -l; }
count_is() { [[ $(count "$1") -eq $2 ]]; }

# A PATH with a numactl, so the binding branch is taken whether or not this box has numactl.
mkdir -p "$work/bin"
cat >"$work/bin/numactl" <<'EOF'
#!/usr/bin/env bash
bound=()
while [[ $1 == --* ]]; do bound+=("$1"); shift; done
COLIBRI_TEST_NUMACTL="${bound[*]}" exec "$@"
EOF
chmod +x "$work/bin/numactl"
export COLIBRI_NODE=/opt/colibri/colibri-node
unset OMPI_MCA_btl_vader_single_copy_mechanism OMPI_MCA_mpi_yield_when_idle COLIBRI_NUMACTL \
  CUDA_VISIBLE_DEVICES CUDA_DEVICE_ORDER OMPI_MCA_btl_vader_eager_limit OMPI_MCA_btl_vader_max_send_size
# Whether this box runs under a syscall filter must not change the expected lines.
printf 'Name:\tbash\nSeccomp:\t0\n' >"$work/status-open"
printf 'Name:\tbash\nSeccomp:\t2\n' >"$work/status-filter"
export COLIBRI_PROC_STATUS=$work/status-open
if (($(id -u) == 0)); then root_flag=1; else root_flag=0; fi
root_ok() { if ((root_flag)); then has --allow-run-as-root; else lacks --allow-run-as-root; fi; }

dry() {  # dry CORES ARGS...: runs the launcher with --dry-run; sets out and err
  local cores=$1
  shift
  out=$(COLIBRI_LOCAL_CORES=$cores PATH="$work/bin:$PATH" "$launch" --dry-run "$@" 2>"$work/err")
  err=$(<"$work/err")
}

# ---- localhost: 7 CPU ranks on a 2-core box, then on a 16-core one ----------------------------
dry 2 --hostfile "$hf/localhost" --layout "$hf/localhost.layout" -- --model MODEL_DIR
check "localhost: starts with mpirun" [ "${out%% *}" = mpirun ]
check "localhost: the hostfile" has "--hostfile $hf/localhost "
check "localhost: 7 app contexts of one rank" count_is "-np 1 " 7
check "localhost: 6 separators" count_is " : " 6
check "localhost: --layout for every rank" \
  count_is "--layout $hf/localhost.layout --model MODEL_DIR" 7
check "localhost: the binary from COLIBRI_NODE" count_is "/opt/colibri/colibri-node" 7
check "localhost: no GPU" lacks CUDA_VISIBLE_DEVICES
check "localhost: no NUMA binding" lacks numactl
check "localhost: --oversubscribe on 2 cores" has --oversubscribe
check "localhost: yield when idle on 2 cores" has "--mca mpi_yield_when_idle 1"
check "localhost: eager messages up to 64 KiB" has "--mca btl_vader_eager_limit 65536 --mca btl_vader_max_send_size 65536"
check "localhost, no syscall filter: Open MPI's single copy" lacks btl_vader_single_copy_mechanism
check "localhost: --allow-run-as-root iff root" root_ok
check "localhost: one line" [ "$(wc -l <<<"$out")" -eq 1 ]
check "localhost: no warning" [ -z "$err" ]

dry 16 --hostfile "$hf/localhost" --layout "$hf/localhost.layout"
check "localhost, 16 cores: no --oversubscribe" lacks --oversubscribe
check "localhost, 16 cores: no yield" lacks mpi_yield_when_idle
check "localhost, 16 cores: vader still set" has "btl_vader_eager_limit 65536"
COLIBRI_PROC_STATUS=$work/status-filter dry 2
check "a syscall filter: vader without single copy" has "--mca btl_vader_single_copy_mechanism none"

# ---- the seed machine, 7 ranks: one GPU each, bound to its socket ------------------------------
dry 24 --hostfile "$hf/seed-6x5090" --layout "$hf/seed-6x5090.layout"
check "seed: the hostfile" has "--hostfile $hf/seed-6x5090 "
check "seed: 7 app contexts" count_is "-np 1 " 7
for gpu in 0 1 2 3 4 5; do
  check "seed: GPU $gpu visible to one rank" count_is "-x CUDA_VISIBLE_DEVICES=$gpu " 1
done
coordinator_has_no_gpu() { local first=${out%% : *}; [[ $first != *CUDA_VISIBLE_DEVICES* ]]; }
check "seed: the coordinator sees all GPUs" coordinator_has_no_gpu
check "seed: rank 1 on GPU 0, socket 0" \
  has ": -np 1 -x CUDA_DEVICE_ORDER=PCI_BUS_ID -x CUDA_VISIBLE_DEVICES=0 $work/bin/numactl\
 --cpunodebind=0 --membind=0 /opt/colibri/colibri-node"
check "seed: 3 ranks on socket 0" count_is "--cpunodebind=0 --membind=0" 3
check "seed: 3 ranks on socket 1" count_is "--cpunodebind=1 --membind=1" 3
check "seed: no --oversubscribe on 24 cores" lacks --oversubscribe
check "seed: GPUs counted in PCI bus order" count_is "-x CUDA_DEVICE_ORDER=PCI_BUS_ID " 6

# ---- the seed machine with NCCL: the coordinator on GPU 0, five GPU ranks, one socket rank ------
dry 24 --hostfile "$hf/seed-6x5090-nccl" --layout "$hf/seed-6x5090-nccl.layout"
check "seed nccl: 7 app contexts" count_is "-np 1 " 7
for gpu in 0 1 2 3 4 5; do
  check "seed nccl: GPU $gpu visible to one rank" count_is "-x CUDA_VISIBLE_DEVICES=$gpu " 1
done
coordinator_on_gpu0() { local first=${out%% : *}; [[ $first == *CUDA_VISIBLE_DEVICES=0* ]]; }
check "seed nccl: the coordinator sees GPU 0" coordinator_on_gpu0
check "seed nccl: 3 ranks on socket 0" count_is "--cpunodebind=0 --membind=0" 3
check "seed nccl: 4 ranks on socket 1" count_is "--cpunodebind=1 --membind=1" 4

CUDA_DEVICE_ORDER=FASTEST_FIRST CUDA_VISIBLE_DEVICES=3 dry 24 --layout "$hf/seed-6x5090.layout"
check "seed: the user's CUDA_DEVICE_ORDER wins" lacks CUDA_DEVICE_ORDER
check "seed: a warning that CUDA_VISIBLE_DEVICES is replaced" \
  grep -q "CUDA_VISIBLE_DEVICES=3 is replaced per rank" <<<"$err"

COLIBRI_NUMACTL=none dry 24 --hostfile "$hf/seed-6x5090" --layout "$hf/seed-6x5090.layout"
check "seed without numactl: a warning" grep -q "warning: numactl not found" <<<"$err"
check "seed without numactl: no binding" lacks cpunodebind
check "seed without numactl: GPUs still set" count_is CUDA_VISIBLE_DEVICES= 6

# ---- the seed machine, 9 ranks: plus one CPU expert rank per socket ----------------------------
dry 24 --hostfile "$hf/seed-6x5090-numa" --layout "$hf/seed-6x5090-numa.layout"
check "seed-numa: 9 app contexts" count_is "-np 1 " 9
check "seed-numa: 6 GPU ranks" count_is CUDA_VISIBLE_DEVICES= 6
check "seed-numa: 8 bound ranks" count_is "numactl --cpunodebind" 8
check "seed-numa: rank 8 is a CPU rank on socket 1" \
  [ "$(cut -d' ' -f1-6 <<<"${out##* : }")" = \
    "-np 1 $work/bin/numactl --cpunodebind=1 --membind=1 /opt/colibri/colibri-node" ]
check "seed-numa: 9 ranks fit 9 slots" lacks --oversubscribe

# ---- two hosts: no rank on this box, GPU indices restart per host ------------------------------
dry 2 --hostfile "$hf/two-hosts" --layout "$hf/two-hosts.layout"
check "two-hosts: the hostfile" has "--hostfile $hf/two-hosts "
check "two-hosts: 10 app contexts" count_is "-np 1 " 10
check "two-hosts: GPU 0 on each host" count_is "CUDA_VISIBLE_DEVICES=0 " 2
check "two-hosts: 8 GPU ranks" count_is CUDA_VISIBLE_DEVICES= 8
check "two-hosts: remote ranks do not oversubscribe this box" lacks --oversubscribe

# ---- every committed pair: the launcher accepts it and np matches the hostfile ------------------
for layout in "$hf"/*.layout; do
  name=$(basename "$layout" .layout)
  ranks=$(sed 's/#.*//' "$layout" | awk 'NF' | wc -l)
  dry 64 --hostfile "$hf/$name" --layout "$layout"
  check "$name: $ranks app contexts" count_is "-np 1 " "$ranks"
  check "$name: no slot warning" [ "${err/slots/}" = "$err" ]
done

# ---- options, defaults and overrides -----------------------------------------------------------
dry 2 --hostfile "$hf/localhost"
check "no layout: one app context of 7 ranks" has " -np 7 /opt/colibri/colibri-node"
check "no layout: no --layout" lacks --layout

dry 64
check "nothing: 7 ranks here" [ "${out##*-np }" = "7 /opt/colibri/colibri-node" ]
check "nothing: no hostfile" lacks --hostfile

dry 64 --np 3 --mca mpi_yield_when_idle 0 -- --prompt "it's two words"
check "--np 3" has " -np 3 "
check "--mca passes through" has "--mca mpi_yield_when_idle 0"
args=()
eval "args=($out)"
check "the line is shell-quoted" [ "${args[-1]}" = "it's two words" ]

OMPI_MCA_btl_vader_single_copy_mechanism=cma COLIBRI_PROC_STATUS=$work/status-filter dry 2
check "the user's vader setting wins" lacks btl_vader_single_copy_mechanism
OMPI_MCA_btl_vader_eager_limit=4096 dry 2
check "the user's eager limit wins" lacks "btl_vader_eager_limit 65536"
OMPI_MCA_mpi_yield_when_idle=0 dry 2
check "the user's yield setting wins" lacks "mpi_yield_when_idle 1"

# ---- --auto-tier: the layout of `colibri-node plan --search` ----------------------------------
# A stand-in colibri-node: `plan` records its arguments and writes a 3-rank layout to --search-out.
cat >"$work/plan-node" <<'EOF'
#!/usr/bin/env bash
if [[ $1 == tune ]]; then  # a tuned profile for every job: bf16 wire and two threads
  echo "$*" >"$AUTO_ARGS.tune"
  printf 'arg --wire\narg bf16\nenv OMP_NUM_THREADS=2\n'
  exit 0
fi
[[ $1 == plan ]] || exit 3
echo "$*" >"$AUTO_ARGS"
while (($#)); do
  [[ $1 == --search-out ]] && out=$2
  shift
done
printf '# colibri-node plan --search: stand-in\n0 coordinator\n1 cpu-expert - - 2.5\n2 cpu-expert - - 2.5\n' >"$out"
EOF
chmod +x "$work/plan-node"
auto() {  # auto ARGS...: --dry-run --auto-tier with the stand-in; sets out, err and args
  rm -f "$work/auto-args" "$work/auto-args.tune" "$work/auto.layout"
  out=$(AUTO_ARGS=$work/auto-args COLIBRI_AUTO_LAYOUT=$work/auto.layout COLIBRI_NODE=$work/plan-node \
    COLIBRI_LOCAL_CORES=2 PATH="$work/bin:$PATH" "$launch" --dry-run --auto-tier "$@" 2>"$work/err")
  err=$(<"$work/err")
  args=$(cat "$work/auto-args" 2>/dev/null || true)
}
auto -- --model /models/m --ngen 3
check "--auto-tier: the searched layout, one app context a rank" count_is "--layout $work/auto.layout" 3
check "--auto-tier: plan --search for the run's model, both budgets" \
  [ "$args" = "plan --model /models/m --search --search-out $work/auto.layout --search-budgets ram,vram --batches 1" ]
check "--auto-tier: says what it chose" grep -qF "colibri-launch: --auto-tier: colibri-node plan --search: stand-in; layout $work/auto.layout" <<<"$err"
auto --hardware /hw.json -- --model=/models/m --ram-gb 4
check "--auto-tier: an explicit --ram-gb keeps that budget out, --hardware passed on" \
  [ "$args" = "plan --model /models/m --search --search-out $work/auto.layout --search-budgets vram --batches 1 --hardware /hw.json" ]
auto --np 3 -- --model /models/m
check "--auto-tier: an explicit --np wins (no search)" [ -z "$args" ]
check "--auto-tier: ... and says so" grep -qF "used as given" <<<"$err"
check "--auto-tier: the plain 3-rank command, with the tuned wire" \
  has "-np 3 $work/plan-node --wire bf16 --model /models/m"
check "--auto-tier: the tuned profile asked for this job" \
  [ "$(cat "$work/auto-args.tune")" = "tune --apply --model /models/m --np 3" ]
auto -- --model /models/m --wire f32
check "--auto-tier: the searched layout's job asks for its profile" \
  [ "$(cat "$work/auto-args.tune")" = "tune --apply --model /models/m --layout $work/auto.layout" ]
check "--auto-tier: an explicit --wire wins over the tuned one" lacks "bf16"
check "--auto-tier: ... and the user's value is kept" has "--model /models/m --wire f32"

# ---- errors ------------------------------------------------------------------------------------
fails() {  # fails EXPECTED_MESSAGE ARGS...: exit 2 (die); cores from $fail_cores, else 2
  local expected=$1 rc=0
  shift
  COLIBRI_LOCAL_CORES=${fail_cores-2} "$launch" --dry-run "$@" >"$work/out" 2>"$work/err" || rc=$?
  ((rc == 2)) || { echo "exit $rc"; cat "$work/err"; return 1; }
  grep -qF -- "$expected" "$work/err" || { cat "$work/err"; return 1; }
}
fails_in_one_line() {  # fails_in_one_line EXPECTED_MESSAGE ARGS...: fails, with nothing else said
  fails "$@" || return 1
  [[ $(wc -l <"$work/err") -eq 1 ]] || { cat "$work/err"; return 1; }
}
check "--np against the layout" fails "--np 5, but layout" --np 5 --layout "$hf/localhost.layout"
check "a missing layout" fails "layout file 'nope.layout' not found" --layout nope.layout
check "a missing hostfile" fails "hostfile 'nope' not found" --hostfile nope
check "--auto-tier without the run's --model" fails "--auto-tier needs the run's --model DIR" \
  --auto-tier -- --ngen 3
check "--hardware without --auto-tier" fails "--hardware is for --auto-tier" --hardware /hw.json
printf '0 coordinator\n1 gpu-expert -\n' >"$work/bad.layout"
check "a gpu-expert without GPU, with file:line" \
  fails "bad.layout:2: gpu is missing" --layout "$work/bad.layout"
printf '0 coordinator\n2 cpu-expert\n' >"$work/gap.layout"
check "a missing rank" fails "rank 1 is missing" --layout "$work/gap.layout"

# Every number read is a count from 1 to 1048576; a bad one in a hostfile is named by file:line.
count_rule="is not a positive integer up to 1048576"
slots_hf=$(readlink -f "$work")/slots
for value in -1 abc 0 1e20 "" 99999999999999999999 +4 1048577; do
  printf '# two hosts\nlocalhost slots=2\nnode-b slots=%s max_slots=4\n' "$value" >"$slots_hf"
  check "hostfile slots=$value: refused at file:line" \
    fails_in_one_line "$slots_hf:3: slots '$value' $count_rule" --hostfile "$slots_hf"
done
for value in 0 abc 99999999999999999999; do
  printf 'localhost slots=2 max_slots=%s\n' "$value" >"$slots_hf"
  check "hostfile max_slots=$value: refused at file:line" \
    fails_in_one_line "$slots_hf:1: max_slots '$value' $count_rule" --hostfile "$slots_hf"
done
printf 'localhost slots=1048576 max_slots=1048576 foo=bar\n' >"$slots_hf"
dry 64 --hostfile "$slots_hf"
check "hostfile slots=1048576, an unknown key: accepted" has " -np 1048576 /opt/colibri/colibri-node"
printf 'localhost\tslots=05' >"$slots_hf"  # a tab, a leading zero, no final newline
dry 64 --hostfile "$slots_hf"
check "hostfile slots=05: 5 ranks" has " -np 5 /opt/colibri/colibri-node"
for value in 99999999999999999999 -1 abc 0 "" 1048577; do
  check "--np '$value': refused" fails_in_one_line "--np '$value' $count_rule" --np "$value"
done
check "--np= empty: refused" fails_in_one_line "--np '' $count_rule" --np=
for value in abc -1 0 99999999999999999999; do
  fail_cores=$value check "COLIBRI_LOCAL_CORES=$value: refused" \
    fails_in_one_line "COLIBRI_LOCAL_CORES='$value' $count_rule"
done

# ---- a real mpirun: each rank reports its GPU, NUMA binding and arguments ----------------------
if command -v mpirun >/dev/null; then
  cat >"$work/node" <<'EOF'
#!/usr/bin/env bash
echo "rank=$OMPI_COMM_WORLD_RANK gpu=${CUDA_VISIBLE_DEVICES-unset}" \
  "numa=${COLIBRI_TEST_NUMACTL-unset} yield=${OMPI_MCA_mpi_yield_when_idle-unset} args=$*"
EOF
  chmod +x "$work/node"
  out=$(COLIBRI_NODE=$work/node COLIBRI_LOCAL_CORES=2 PATH="$work/bin:$PATH" timeout 60 \
    "$launch" --hostfile "$hf/seed-6x5090-numa" --layout "$hf/seed-6x5090-numa.layout" \
    -- --ngen 3 2>&1) || true
  for r in 0 1 2 3 4 5 6 7 8; do
    line=$(grep "^rank=$r " <<<"$out" || true)
    if ((r == 0)); then  # the coordinator: no GPU, unbound
      want="gpu=unset numa=unset"
    elif ((r <= 6)); then  # GPU r-1, GPUs 0-2 on socket 0
      socket=$(((r - 1) / 3))
      want="gpu=$((r - 1)) numa=--cpunodebind=$socket --membind=$socket"
    else  # CPU expert ranks 7 and 8 on sockets 0 and 1
      want="gpu=unset numa=--cpunodebind=$((r - 7)) --membind=$((r - 7))"
    fi
    check "mpirun: rank $r: $want" \
      [ "$line" = "rank=$r $want yield=1 args=--layout $hf/seed-6x5090-numa.layout --ngen 3" ]
  done
  ((failures == 0)) || echo "$out"
else
  echo "skip  mpirun: not installed"
fi

if ((failures)); then
  echo "$failures check(s) failed"
  exit 1
fi
echo "all checks passed"
