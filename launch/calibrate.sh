#!/usr/bin/env bash
# Measures this machine for `colibri-node plan` (docs/PLAN.md): read bandwidth, the expert kernels
# per weight format, the coordinator's matrix product and the disk as one process, then the
# exchange between two ranks under mpirun (through launch/colibri-launch). Arguments go to both
# steps: --out FILE (default ~/.config/colibri-node/hardware.json, where plan looks), --quick,
# --scratch DIR (the disk test's directory), --hidden N (the exchange's row size).
# Environment: COLIBRI_NODE (default: build/src/colibri-node, else from PATH).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
node=${COLIBRI_NODE:-}
if [[ -z $node ]]; then
  node=$here/../build/src/colibri-node
  [[ -x $node ]] || node=$(command -v colibri-node || true)
fi
[[ -n $node && -x $node ]] || {
  echo "calibrate.sh: error: no colibri-node binary (build it, or set COLIBRI_NODE)" >&2
  exit 2
}
"$node" calibrate "$@"
COLIBRI_NODE=$node "$here/colibri-launch" --np 2 -- calibrate --exchange "$@"
