#!/usr/bin/env bash
# dashboard_bench.sh: what a client polling the dashboard's JSON costs a decode step. Starts
# `mpirun -np NP colibri-node --serve` on MODEL, then runs ROUNDS interleaved pairs (the order
# alternating within each pair): one greedy request of MAX_TOKENS tokens alone, and the same
# request while a client fetches /dashboard/state every POLL_S seconds (the page polls every 1 s),
# or with POLLER=browser while headless Chromium shows /dashboard (the page itself, polling once a
# second and drawing, on the same machine: the worst place for it).
# A run's step time is the change of colibri_iteration_seconds_sum over the change of
# colibri_iteration_seconds_count in /metrics across the request (the scheduler's own timing of
# each forward call). Prints a line per run, the medians, the median of the paired differences,
# and one JSON line.
#
#   bench/dashboard_bench.sh [MODEL_DIR]   (default: models/glm5-tiny-kjv)
#   NP (3), ROUNDS (10), MAX_TOKENS (1000), POLL_S (0.1), POLLER (client, or browser),
#   BROWSER_SETTLE_S (5: seconds between the browser's start and the request), BROWSER_PAGE
#   (blank: the browser on about:blank, the control)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=bench/serve_start.sh
source "$root/bench/serve_start.sh"
model=${1:-$root/models/glm5-tiny-kjv}
np=${NP:-3} rounds=${ROUNDS:-10} max_tokens=${MAX_TOKENS:-1000} poll_s=${POLL_S:-0.1}
node=$root/build/src/colibri-node
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1
log=$(mktemp)
mpirun --oversubscribe -np "$np" "$node" --model "$model" --serve --port 0 --quiet 2>"$log" &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true; rm -f "$log"' EXIT
wait_for_server "$log" $server

python3 - "$port" "$rounds" "$max_tokens" "$poll_s" "$np" "$(basename "$model")" "${POLLER:-client}" <<'EOF'
import json, os, signal, statistics, subprocess, sys, tempfile, threading, time, urllib.request

port, rounds, max_tokens, poll_s = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
np, model, poller_kind = int(sys.argv[5]), sys.argv[6], sys.argv[7]
settle_s = float(os.environ.get("BROWSER_SETTLE_S", "5"))
base = f"http://127.0.0.1:{port}"
# BROWSER_PAGE=blank: the same browser on about:blank, the control for what the page itself costs.
page_url = "about:blank" if os.environ.get("BROWSER_PAGE") == "blank" else base + "/dashboard"

def get(path):
    with urllib.request.urlopen(base + path, timeout=30) as r:
        return r.read()

def step_counters():
    sums = {}
    for line in get("/metrics").decode().splitlines():
        for name in ("colibri_iteration_seconds_sum", "colibri_iteration_seconds_count"):
            if line.startswith(name + " "):
                sums[name] = float(line.split()[1])
    return sums["colibri_iteration_seconds_sum"], sums["colibri_iteration_seconds_count"]

def request():
    body = json.dumps({"prompt": "And God said,", "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()

def browser():
    profile = tempfile.mkdtemp(prefix="dashboard-bench-")
    return subprocess.Popen(["chromium", "--headless", "--no-sandbox", "--disable-gpu",
                             "--no-first-run", "--user-data-dir=" + profile,
                             "--remote-debugging-port=0", page_url],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)

def run(poll):
    stop = threading.Event()
    polls = [0]
    def poller():
        while not stop.is_set():
            get("/dashboard/state")
            polls[0] += 1
            stop.wait(poll_s)
    thread = threading.Thread(target=poller) if poll and poller_kind == "client" else None
    page = browser() if poll and poller_kind == "browser" else None
    if page:
        time.sleep(settle_s)  # started, and past its start-up, before the request
    s0, c0 = step_counters()
    if thread:
        thread.start()
    try:
        request()
    finally:
        stop.set()
        if thread:
            thread.join()
        if page:
            os.killpg(page.pid, signal.SIGKILL)
            page.wait(timeout=10)
    s1, c1 = step_counters()
    return (s1 - s0) / (c1 - c0) * 1e6, polls[0]

request()  # warm-up
alone, polled, diffs = [], [], []
for r in range(rounds):
    order = (False, True) if r % 2 == 0 else (True, False)
    pair = {}
    for poll in order:
        us, polls = run(poll)
        pair[poll] = us
        print(f"round {r} {'polled' if poll else 'alone '}: {us:8.1f} us/step" +
              (f" ({polls} polls)" if poll and poller_kind == "client" else ""), flush=True)
    alone.append(pair[False]); polled.append(pair[True]); diffs.append(pair[True] - pair[False])
state_bytes = len(get("/dashboard/state"))
m_alone, m_polled, m_diff = statistics.median(alone), statistics.median(polled), statistics.median(diffs)
how = f"polled every {poll_s} s" if poller_kind == "client" else f"with Chromium on {page_url}"
print(f"median step: alone {m_alone:.1f} us, {how} {m_polled:.1f} us; "
      f"median paired difference {m_diff:+.1f} us ({100 * m_diff / m_alone:+.2f} %); "
      f"spread of alone (min-max) {min(alone):.1f}-{max(alone):.1f} us; state {state_bytes} bytes")
print(json.dumps({"bench": "dashboard", "model": model, "np": np, "rounds": rounds,
                  "max_tokens": max_tokens, "poller": poller_kind, "poll_s": poll_s, "alone_us": alone,
                  "polled_us": polled, "median_alone_us": m_alone, "median_polled_us": m_polled,
                  "median_diff_us": m_diff, "state_bytes": state_bytes}))
EOF
