#!/usr/bin/env bash
# launch/colibri-slurm.sbatch as a dry run (COLIBRI_DRY_RUN=1) inside a fake allocation: stand-ins
# for scontrol and srun on PATH, Slurm's variables set by hand. Checks the hostfile and layout it
# makes from the allocation, the command colibri-launch prints, and its errors.
# Usage: slurm_test.sh REPO_ROOT
set -euo pipefail

root=$(cd "${1:?usage: slurm_test.sh REPO_ROOT}" && pwd)
script=$root/launch/colibri-slurm.sbatch
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
err_has() { [[ $err == *"$1"* ]]; }
count_is() { [[ $(grep -oF -- "$1" <<<"$out" | wc -l) -eq $2 ]]; }

# scontrol: `show hostnames LIST` prints FAKE_NODES, one per line. srun: records its arguments,
# then prints "node gpus" for each of FAKE_GPUS ("node-a:4 node-b:2"), last node first (tasks
# answer in any order); FAKE_SRUN_FAIL makes it fail.
mkdir -p "$work/bin"
cat >"$work/bin/scontrol" <<'EOF'
#!/usr/bin/env bash
[[ $1 == show && $2 == hostnames && -n $3 ]] || { echo "scontrol: unexpected: $*" >&2; exit 1; }
tr ' ' '\n' <<<"$FAKE_NODES"
EOF
cat >"$work/bin/srun" <<'EOF'
#!/usr/bin/env bash
echo "$*" >>"$FAKE_SRUN_LOG"
[[ -z ${FAKE_SRUN_FAIL:-} ]] || { echo "srun: error: Unable to create step" >&2; exit 1; }
for pair in $(tr ' ' '\n' <<<"$FAKE_GPUS" | tac); do echo "${pair%%:*} ${pair#*:}"; done
EOF
chmod +x "$work/bin/scontrol" "$work/bin/srun"

run() {  # run ENV... -- ARGS: the script in the fake allocation; sets out, err, status
  local env=()
  while [[ $1 != -- ]]; do env+=("$1"); shift; done
  shift
  status=0
  out=$(env -i PATH="$work/bin:$PATH" HOME="$work" SLURM_JOB_ID=42 SLURM_SUBMIT_DIR="$work" \
    COLIBRI_ROOT="$root" COLIBRI_DRY_RUN=1 COLIBRI_NODE=/opt/colibri/colibri-node \
    COLIBRI_LOCAL_CORES=64 COLIBRI_NUMACTL=none FAKE_SRUN_LOG="$work/srun.log" "${env[@]}" \
    bash "$script" "$@" 2>"$work/err") || status=$?
  err=$(<"$work/err")
}

# ---- two nodes of 5 tasks, 4 GPUs on the first and 2 on the second -----------------------------
run SLURM_JOB_NODELIST='node-[a-b]' SLURM_TASKS_PER_NODE='5(x2)' FAKE_NODES='node-a node-b' \
  FAKE_GPUS='node-a:4 node-b:2' -- -- --model MODEL_DIR --prompt-ids 1,2,3
check "two nodes: exit 0" [ "$status" -eq 0 ]
check "two nodes: no error output" [ -z "$err" ]
hostfile=$work/colibri-slurm-42/hostfile
layout=$work/colibri-slurm-42/layout
check "two nodes: hostfile written" [ -f "$hostfile" ]
check "two nodes: hostfile" [ "$(grep -v '^#' "$hostfile")" = $'node-a slots=5\nnode-b slots=5' ]
expected_layout='0 coordinator -
1 gpu-expert 0
2 gpu-expert 1
3 gpu-expert 2
4 gpu-expert 3
5 gpu-expert 0
6 gpu-expert 1
7 cpu-expert -
8 cpu-expert -
9 cpu-expert -'
check "two nodes: layout" [ "$(grep -v '^#' "$layout" | tr -s ' ')" = "$expected_layout" ]
check "two nodes: srun once" [ "$(wc -l <"$work/srun.log")" -eq 1 ]
check "two nodes: srun one task per node" \
  [ "$(cut -d' ' -f1-5 "$work/srun.log")" = "--nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 bash" ]
command=$(sed -n '/^== command$/{n;p}' <<<"$out")
out=$command
check "two nodes: mpirun with the hostfile" has "mpirun "
check "two nodes: the generated hostfile" has "--hostfile $hostfile "
check "two nodes: 10 app contexts" count_is "-np 1 " 10
check "two nodes: 6 GPU ranks" count_is "CUDA_VISIBLE_DEVICES=" 6
check "two nodes: GPU 0 on two ranks (one per node)" count_is "CUDA_VISIBLE_DEVICES=0 " 2
check "two nodes: GPU 3 on one rank" count_is "CUDA_VISIBLE_DEVICES=3 " 1
check "two nodes: the user's arguments on every rank" \
  count_is "--layout $layout --model MODEL_DIR --prompt-ids 1,2,3" 10

# ---- uneven tasks, no GPUs --------------------------------------------------------------------
rm -f "$work/srun.log"
run SLURM_JOB_NODELIST='c[1-3]' SLURM_TASKS_PER_NODE='3,2(x2)' FAKE_NODES='c1 c2 c3' \
  FAKE_GPUS='c1:0 c2:0 c3:0' COLIBRI_SLURM_DIR="$work/cpu" -- --model M
check "cpu nodes: exit 0" [ "$status" -eq 0 ]
check "cpu nodes: hostfile" \
  [ "$(grep -v '^#' "$work/cpu/hostfile")" = $'c1 slots=3\nc2 slots=2\nc3 slots=2' ]
check "cpu nodes: 6 cpu-expert ranks" [ "$(grep -c cpu-expert "$work/cpu/layout")" -eq 6 ]
check "cpu nodes: 7 app contexts" count_is "-np 1 " 7
check "cpu nodes: no GPU" [ "$(grep -c CUDA_VISIBLE_DEVICES <<<"$out")" -eq 0 ]

# ---- errors: one line each, exit 2 -------------------------------------------------------------
run -- --model M
check "outside an allocation: exit 2" [ "$status" -eq 2 ]
check "outside an allocation: says so" err_has "not inside a Slurm allocation"
run SLURM_JOB_NODELIST='n[1-2]' SLURM_TASKS_PER_NODE='4(x2)' FAKE_NODES='n1 n2' FAKE_GPUS='n1:1' \
  FAKE_SRUN_FAIL=1 -- --model M
check "srun fails: exit 2" [ "$status" -eq 2 ]
check "srun fails: says so" err_has "srun could not count the GPUs"
run SLURM_JOB_NODELIST='n[1-2]' SLURM_TASKS_PER_NODE='4(x2)' FAKE_NODES='n1 n2' FAKE_GPUS='n1:1' \
  -- --model M
check "a node without an answer: named" err_has "no GPU count for node 'n2'"
run SLURM_JOB_NODELIST='n[1-2]' SLURM_TASKS_PER_NODE='4' FAKE_NODES='n1 n2' FAKE_GPUS='n1:1 n2:1' \
  -- --model M
check "tasks for fewer nodes than listed: refused" err_has "gives 1 nodes, the node list 2"
run SLURM_JOB_NODELIST='n1' SLURM_TASKS_PER_NODE='4' FAKE_NODES='n1' FAKE_GPUS='n1:1' \
  COLIBRI_ROOT="$work" -- --model M
check "no repository: named" err_has "no launch/colibri-launch under '$work'"

if ((failures > 0)); then
  echo "slurm_test: ${failures} checks failed"
  exit 1
fi
echo "slurm_test: all checks passed"
