#!/usr/bin/env bash
# Test hosts on one machine: Linux network namespaces joined by a bridge, for running colibri-node
# across "hosts" that talk over Open MPI's TCP transport only. See docs/LAUNCH.md, "Test hosts".
#
#   launch/netns-hosts.sh up N [--name NAME] [--head-slots S] [--slots S]
#   launch/netns-hosts.sh down [--name NAME]
#   launch/netns-hosts.sh link none|10g|25g|100g [--name NAME]
#   launch/netns-hosts.sh gc
#
# `up` makes namespaces NAME-head (where mpirun runs) and NAME-h1 .. NAME-hN, each with one veth
# `eth0` joined to the bridge `br0` in the namespace NAME-net, at 198.18.0.1 (head) and
# 198.18.0.(1+i) (host i) in 198.18.0.0/24 (RFC 2544 benchmarking range; no route leaves the
# bridge). Each set of namespaces is a network of its own, so sets with different names never
# collide. It writes, in the state directory ($COLIBRI_NETNS_DIR or /run/colibri-netns/NAME):
#   hostfile  Open MPI hostfile: NAME-head with --head-slots (default 1), NAME-hI with --slots
#             (default 2); the names need no resolver: the agent knows them, mpirun knows the head
#             as its own hostname, and the daemons report their addresses themselves
#   rsh       the rsh agent for Open MPI (plm_rsh_agent): `rsh HOST COMMAND...` runs COMMAND in
#             the namespace of HOST, with its own UTS namespace whose hostname is the namespace
#             name, so that ranks name their host (rank 3@NAME-h2)
#   mpirun    `mpirun ARGS` in the head namespace (hostname NAME-head) with the hostfile, the
#             agent, and TCP restricted to the bridge's subnet (btl tcp,self; oob tcp); the
#             mpirun is $COLIBRI_MPIRUN (default: mpirun from PATH) as found at `up`
#   owner     the pid given in $COLIBRI_NETNS_OWNER, if any: `gc` removes the sets under
#             /run/colibri-netns whose owner is gone (left by a test that was killed)
# `up` on a name that exists first takes the old set down. `down` removes the namespaces (killing
# any process left in them) and the state directory; it succeeds when there is nothing to remove.
# Without the privilege to make namespaces, `up` exits with status 77 and one line saying why.
# `link` shapes every host's link, both directions, as an Ethernet of that speed: the rate with
# tc tbf (burst one 250 Hz tick at the rate, at least 64 KiB), plus a one-way delay of 10, 5 or
# 2 us with tc netem where the kernel has sch_netem (otherwise it says so and shapes the rate
# only); `none` removes the shaping.
set -euo pipefail

readonly SUBNET_PREFIX=198.18.0
readonly SUBNET_BITS=24

die() {
  echo "netns-hosts: error: $*" >&2
  exit 1
}

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 2
}

state_dir() { echo "${COLIBRI_NETNS_DIR:-/run/colibri-netns/$1}"; }

namespaces_of() {  # every namespace of set $1
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$1-(head|net|h[0-9]+)\$" || true
}

# Kills every process in namespace $1, then deletes it.
remove_namespace() {
  local ns=$1 pids
  pids=$(ip netns pids "$ns" 2>/dev/null || true)
  if [[ -n $pids ]]; then
    # shellcheck disable=SC2086  # one pid per word
    kill -KILL $pids 2>/dev/null || true
    for _ in $(seq 50); do
      [[ -z $(ip netns pids "$ns" 2>/dev/null || true) ]] && break
      sleep 0.1
    done
  fi
  ip netns delete "$ns" 2>/dev/null || true
}

down() {
  local name=$1 ns
  # Hosts first: their processes go before the head's mpirun notices.
  for ns in $(namespaces_of "$name" | sort -r); do remove_namespace "$ns"; done
  rm -rf "$(state_dir "$name")"
}

check_name() {
  [[ $1 =~ ^[A-Za-z][A-Za-z0-9_-]{0,39}$ ]] ||
    die "name '$1' must be a letter then up to 39 letters, digits, '-' or '_'"
}

check_privilege() {
  local probe="colibri-probe-$$"
  local reason
  if ! command -v ip >/dev/null; then
    echo "netns-hosts: cannot make namespaces: iproute2 ('ip') is not installed" >&2
    exit 77
  fi
  if ! command -v unshare >/dev/null; then
    echo "netns-hosts: cannot make namespaces: unshare (util-linux) is not installed" >&2
    exit 77
  fi
  if ! reason=$(ip netns add "$probe" 2>&1); then
    echo "netns-hosts: cannot make namespaces: 'ip netns add' failed: ${reason}" \
      "(needs root or CAP_SYS_ADMIN)" >&2
    exit 77
  fi
  if ! reason=$(ip netns exec "$probe" unshare --uts true 2>&1); then
    ip netns delete "$probe" 2>/dev/null || true
    echo "netns-hosts: cannot make namespaces: 'unshare --uts' failed: ${reason}" >&2
    exit 77
  fi
  ip netns delete "$probe"
}

# Writes the agent, the hostfile and the mpirun wrapper of set $1 with $2 hosts.
write_state() {
  local name=$1 hosts=$2 head_slots=$3 slots=$4 dir
  dir=$(state_dir "$name")
  mkdir -p "$dir"
  {
    echo "# ${name}: head ${SUBNET_PREFIX}.1, hosts ${SUBNET_PREFIX}.2 .. ${SUBNET_PREFIX}.$((hosts + 1))"
    echo "${name}-head slots=${head_slots}"
    for i in $(seq "$hosts"); do echo "${name}-h${i} slots=${slots}"; done
  } >"$dir/hostfile"

  # The agent: Open MPI calls it as `rsh [options] HOST COMMAND...` (ssh style, the command as
  # words for a remote shell). It runs the command in HOST's namespace under a shell, as sshd
  # would, and acts as an ssh connection with keep-alives would: when mpirun (its parent) goes
  # away, or the link of HOST or of the head is down for 1.5 s (the path between them), it ends
  # the command's process group and exits 255, so that mpirun learns that it lost the daemon
  # there instead of waiting for it.
  cat >"$dir/rsh" <<EOF
#!/usr/bin/env bash
# rsh agent for the namespace hosts ${name}: see launch/netns-hosts.sh.
set -uo pipefail
while [[ \$# -gt 0 && \$1 == -* ]]; do shift; done  # ssh options Open MPI may add
host=\${1:?host}
shift
case \$host in
$(for i in $(seq "$hosts"); do
    printf '  %s | %s) ns=%s ;;\n' "${SUBNET_PREFIX}.$((i + 1))" "${name}-h${i}" "${name}-h${i}"
  done)
  ${SUBNET_PREFIX}.1 | ${name}-head) ns=${name}-head ;;
  *) echo "netns rsh: error: unknown host '\$host' (not in ${dir}/hostfile)" >&2; exit 255 ;;
esac
parent=\$PPID
set -m  # the command gets a process group of its own, in this session
# shellcheck disable=SC2016  # expanded by the inner shell
ip netns exec "\$ns" unshare --uts /bin/sh -c 'hostname "\$1" && shift && exec /bin/sh -c "\$*"' \\
  netns-rsh "\$ns" "\$@" &
child=\$!
trap 'kill -KILL -- -\$child 2>/dev/null; exit 255' TERM INT HUP
misses=0
while kill -0 "\$child" 2>/dev/null; do
  read -r _ _ _ ppid _ </proc/\$\$/stat
  if [[ \$ppid != "\$parent" ]]; then  # mpirun is gone: end what it started here
    kill -KILL -- -\$child 2>/dev/null
    exit 255
  fi
  if ip -n "\$ns" -o link show eth0 2>/dev/null | grep -q 'state UP' &&
    ip -n ${name}-head -o link show eth0 2>/dev/null | grep -q 'state UP'; then
    misses=0
  elif ((++misses >= 3)); then
    echo "netns rsh: connection to \$host lost (a link between it and the head is down)" >&2
    kill -KILL -- -\$child 2>/dev/null
    exit 255
  fi
  sleep 0.5
done
wait "\$child"
EOF
  chmod +x "$dir/rsh"

  local mpirun
  mpirun=$(command -v "${COLIBRI_MPIRUN:-mpirun}") || die "no mpirun ('${COLIBRI_MPIRUN:-mpirun}')"
  cat >"$dir/mpirun" <<EOF
#!/usr/bin/env bash
# mpirun in the head namespace of ${name}, across its hosts over TCP: see launch/netns-hosts.sh.
# shellcheck disable=SC2016  # expanded by the inner shell
exec ip netns exec ${name}-head unshare --uts /bin/sh -c 'hostname "\$1" && shift && exec "\$@"' \\
  netns-mpirun ${name}-head "${mpirun}" --hostfile "${dir}/hostfile" \\
  --mca plm_rsh_agent "${dir}/rsh" --mca plm_rsh_no_tree_spawn 1 \\
  --mca btl tcp,self --mca btl_tcp_if_include ${SUBNET_PREFIX}.0/${SUBNET_BITS} \\
  --mca oob tcp --mca oob_tcp_if_include ${SUBNET_PREFIX}.0/${SUBNET_BITS} \\
  --mca pml ob1 --mca orte_leave_session_attached 1 "\$@"
EOF
  chmod +x "$dir/mpirun"
  if [[ -n ${COLIBRI_NETNS_OWNER:-} ]]; then echo "$COLIBRI_NETNS_OWNER" >"$dir/owner"; fi
}

up() {
  local name=$1 hosts=$2 head_slots=$3 slots=$4
  if ! [[ $hosts =~ ^[0-9]+$ ]] || ((hosts < 1 || hosts > 200)); then
    die "N must be 1 .. 200, not '$hosts'"
  fi
  check_privilege
  down "$name"
  local net="${name}-net"
  trap 'down "$name"' ERR
  ip netns add "$net"
  ip -n "$net" link add br0 type bridge
  ip -n "$net" link set br0 up
  ip -n "$net" link set lo up
  local i ns address
  for i in $(seq 0 "$hosts"); do
    if ((i == 0)); then ns="${name}-head"; else ns="${name}-h${i}"; fi
    address="${SUBNET_PREFIX}.$((i + 1))/${SUBNET_BITS}"
    ip netns add "$ns"
    ip -n "$net" link add "v${i}" type veth peer name eth0 netns "$ns"
    ip -n "$net" link set "v${i}" master br0 up
    ip -n "$ns" addr add "$address" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
  done
  write_state "$name" "$hosts" "$head_slots" "$slots"
  trap - ERR
  echo "netns-hosts: ${name}: head + ${hosts} hosts on ${SUBNET_PREFIX}.0/${SUBNET_BITS};" \
    "run: $(state_dir "$name")/mpirun -np N PROGRAM"
}

# Shapes the links of set $1 as model $2 (see the header).
link() {
  local name=$1 model=$2 rate delay_us
  case $model in
    none) rate="" ;;
    10g) rate=10 delay_us=10 ;;
    25g) rate=25 delay_us=5 ;;
    100g) rate=100 delay_us=2 ;;
    *) die "link model '$model' is unknown (none, 10g, 25g, 100g)" ;;
  esac
  ip netns list | grep -q "^${name}-net\b" || die "no namespace hosts named '$name' (up first)"
  local devices=() ns i
  # Each direction of host i's link: its eth0 (out of the host), and v_i on the bridge (into it).
  for ns in $(namespaces_of "$name"); do
    [[ $ns == "${name}-net" ]] && continue
    devices+=("$ns eth0")
    if [[ $ns == "${name}-head" ]]; then i=0; else i=${ns##*-h}; fi
    devices+=("${name}-net v${i}")
  done
  local netem=0
  if [[ -n $rate ]] && ip netns exec "${name}-net" tc qdisc add dev lo root netem delay 1us 2>/dev/null; then
    ip netns exec "${name}-net" tc qdisc del dev lo root
    netem=1
  fi
  local burst=$((rate * 1000000000 / 8 / 250))
  ((burst < 65536)) && burst=65536
  local device
  for device in "${devices[@]}"; do
    read -r ns dev <<<"$device"
    ip netns exec "$ns" tc qdisc del dev "$dev" root 2>/dev/null || true
    [[ -z $rate ]] && continue
    if ((netem)); then
      ip netns exec "$ns" tc qdisc add dev "$dev" root handle 1: netem delay "${delay_us}us"
      ip netns exec "$ns" tc qdisc add dev "$dev" parent 1: handle 2: tbf rate "${rate}gbit" \
        burst "$burst" latency 10ms
    else
      ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "${rate}gbit" burst "$burst" \
        latency 10ms
    fi
  done
  if [[ -z $rate ]]; then
    echo "netns-hosts: ${name}: links unshaped"
  elif ((netem)); then
    echo "netns-hosts: ${name}: links at ${rate} Gbit/s, ${delay_us} us one way"
  else
    echo "netns-hosts: ${name}: links at ${rate} Gbit/s; no added delay (this kernel has no sch_netem)"
  fi
}

# Removes every set whose state directory names an owner pid that is gone.
gc() {
  local root=/run/colibri-netns owner dir
  [[ -d $root ]] || return 0
  for dir in "$root"/*/; do
    [[ -f $dir/owner ]] || continue
    owner=$(<"$dir/owner")
    if ! kill -0 "$owner" 2>/dev/null; then
      echo "netns-hosts: removing $(basename "$dir") (owner ${owner} is gone)"
      COLIBRI_NETNS_DIR="${dir%/}" down "$(basename "$dir")"
    fi
  done
}

(($# >= 1)) || usage
command=$1
shift
count=""
if [[ $command == up || $command == link ]]; then
  (($# >= 1)) || usage
  count=$1
  shift
fi
name=colibri
head_slots=1
slots=2
while (($#)); do
  case $1 in
    --name) name=${2:?--name needs a value}; shift 2 ;;
    --head-slots) head_slots=${2:?}; shift 2 ;;
    --slots) slots=${2:?}; shift 2 ;;
    -h | --help) usage ;;
    *) die "unknown argument '$1'" ;;
  esac
done
check_name "$name"
[[ $head_slots =~ ^[0-9]+$ && $slots =~ ^[1-9][0-9]*$ ]] || die "slots must be counts"
if [[ $command != up && $command != down && $command != gc && $command != link ]]; then usage; fi
if [[ $command != up && $(id -u) != 0 ]]; then
  echo "netns-hosts: cannot remove namespaces: needs root" >&2
  exit 77
fi
case $command in
  up) up "$name" "$count" "$head_slots" "$slots" ;;
  down) down "$name" ;;
  gc) gc ;;
  link) link "$name" "$count" ;;
esac
