#!/usr/bin/env bash
# How mpirun's teardown meets a serving job: starts `mpirun -np 3 colibri-node --serve`, opens one
# long streamed request, sends SIGNAL (INT or TERM) to mpirun a second later, and prints when
# each thing happened (seconds from the start): the signal, the coordinator's lines, the ranks
# still alive (every 0.5 s), mpirun's exit and the stream's last event.
#   bench/teardown_timing.sh INT [mpirun options, e.g. --mca odls_base_sigkill_timeout 30]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
signal=${1:-INT}
shift || true
port=${PORT:-18090}
node=build/src/colibri-node
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_NUM_THREADS=1 OMPI_MCA_mpi_yield_when_idle=1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
start=$(date +%s.%N)
since() { echo "$(date +%s.%N) - $start" | bc; }
mpirun "$@" -np 3 "$node" --serve --port "$port" --quiet 2> >(while IFS= read -r line; do
  echo "$(since) $line"
done >"$out/stderr") >/dev/null &
mpirun_pid=$!
for _ in $(seq 100); do curl -s "localhost:$port/health" | grep -q ok && break; sleep 0.2; done
curl -sN "localhost:$port/v1/completions" \
  -d '{"prompt":"And God said,","max_tokens":2000,"stream":true,"ignore_eos":true}' >"$out/stream" &
curl_pid=$!
sleep 1
echo "$(since) SIG$signal to mpirun"
kill "-$signal" "$mpirun_pid"
(while sleep 0.5; do
  echo "$(since) ranks alive: $(pgrep -f "colibri-node --serve --port $port" | wc -l)"
done) >"$out/ranks" &
watch_pid=$!
status=0
wait "$mpirun_pid" || status=$?
echo "$(since) mpirun exited with $status"
kill "$watch_pid"
wait "$curl_pid" || true
uniq -f 1 "$out/ranks"
grep -v "try:" "$out/stderr"
echo "stream's last event: $(grep '^data:' "$out/stream" | tail -2 | head -1 | cut -c1-160)"
