# serve_start.sh, sourced by the serving benchmarks: wait_for_server LOG PID sets `port` once the
# server started by PID (its stderr in LOG) answers /health, or ends the script with LOG.
wait_for_server() {
  local log=$1 pid=$2
  port=
  for _ in $(seq 1 600); do
    port=$(grep -o 'on http://127.0.0.1:[0-9]*' "$log" | head -n 1 | sed 's/.*://') || true
    [[ -n $port ]] && curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; exit 1; }
    sleep 0.2
  done
  echo "the server did not start" >&2
  cat "$log" >&2
  exit 1
}
