#!/usr/bin/env bash
# prefill_itl_bench.sh: what a long prompt does to running streams, with and without
# --max-itl-ms. Two servers on MODEL, one without the bound and one with --max-itl-ms ITL_MS, both
# up at once and driven one at a time, in ROUNDS interleaved rounds (off, bound, off, bound, ...).
# A round, for each STREAMS count: that many greedy streams of a short prompt decode (ignore_eos);
# once each has sent 8 tokens, a prompt of TOKENS token ids arrives (max_tokens 1, streamed); the
# round measures its time to first token and the inter-token latency of the running streams
# while it prefills (gaps between their tokens that end between its arrival and its first token),
# then closes the streams (their ITL before it arrived is printed too). Medians over rounds of TTFT and the ITL p50/p99; each server's
# step-cost fit from /metrics after the rounds. --no-prefix-cache: every round computes its prompt.
#
#   bench/prefill_itl_bench.sh [MODEL_DIR]   (default: models/glm5-tiny-kjv)
#   NP (1), ITL_MS (20), TOKENS (2000), STREAMS ("1 4"), ROUNDS (5), EXTRA (both servers' flags)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=bench/serve_start.sh
source "$root/bench/serve_start.sh"
model=${1:-$root/models/glm5-tiny-kjv}
np=${NP:-1} itl_ms=${ITL_MS:-20} tokens=${TOKENS:-2000} streams=${STREAMS:-1 4} rounds=${ROUNDS:-5}
node=$root/build/src/colibri-node
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMP_WAIT_POLICY=PASSIVE
work=$(mktemp -d)
pids=()
cleanup() {
  local pid
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

launch=("$node")
((np > 1)) && launch=(mpirun --oversubscribe -np "$np" "$node")
start() {  # start LABEL FLAGS...: sets port
  local label=$1
  shift
  : >"$work/$label.log"
  # shellcheck disable=SC2086
  "${launch[@]}" --model "$model" --serve --port 0 --quiet --max-seqs 8 --kv-tokens 16384 \
    --no-prefix-cache ${EXTRA:-} "$@" 2>"$work/$label.log" &
  pids+=($!)
  wait_for_server "$work/$label.log" $!
}
start off
port_off=$port
start bound --max-itl-ms "$itl_ms"
port_bound=$port

# shellcheck disable=SC2086
python3 - "$port_off" "$port_bound" "$tokens" "$rounds" "$itl_ms" "$np" "$(lscpu | sed -n 's/^Model name: *//p')" \
  "$(cut -d' ' -f1-3 /proc/loadavg)" $streams <<'PY'
import http.client, json, socket, statistics, sys, threading, time
port_off, port_bound, tokens, rounds, itl_ms, np = map(int, sys.argv[1:7])
cpu, load = sys.argv[7], sys.argv[8]
stream_counts = [int(s) for s in sys.argv[9:]]
ports = {"off": port_off, "bound": port_bound}

def post_stream(port, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    sock = c.sock  # the response keeps it; shut down to end the stream
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]}")
    return sock, r

def token_times(r, times, stop):
    """Appends the arrival time of every streamed token event until [DONE] or stop is set."""
    while not stop.is_set():
        try:
            line = r.readline()
        except OSError:  # the stream was shut down
            return
        if not line:
            return
        if line.startswith(b"data: {"):
            j = json.loads(line[6:])
            if j.get("choices") and j["choices"][0].get("token_ids"):
                times.append(time.perf_counter())
        elif line.startswith(b"data: [DONE]"):
            return

def one_round(port, n_streams, round_index):
    stop = threading.Event()
    times = [[] for _ in range(n_streams)]
    conns, threads = [], []
    for i in range(n_streams):
        sock, r = post_stream(port, {"prompt": f"And God said, {i}", "max_tokens": 2000, "temperature": 0,
                                  "ignore_eos": True, "stream": True, "return_token_ids": True})
        conns.append(sock)
        t = threading.Thread(target=token_times, args=(r, times[i], stop), daemon=True)
        t.start()
        threads.append(t)
    deadline = time.perf_counter() + 60
    while any(len(t) < 8 for t in times):
        if time.perf_counter() > deadline:
            raise RuntimeError("the streams did not start")
        time.sleep(0.002)
    # A different prompt every round (the prefix cache is off as well).
    ids = [100 + (k * 7919 + 104729 * (round_index + 1)) % 3900 for k in range(tokens)]
    sent = time.perf_counter()
    sock, r = post_stream(port, {"prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True,
                                 "return_token_ids": True})
    first = []
    token_times(r, first, threading.Event())
    r.close()
    if not first:
        raise RuntimeError("the long prompt got no token")
    ttft = first[0] - sent
    time.sleep(0.05)
    stop.set()
    for sock in conns:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # the stream had ended
            pass
    gaps, before = [], []
    for ts in times:
        gaps += [b - a for a, b in zip(ts, ts[1:]) if sent < b <= first[0]]
        before += [b - a for a, b in zip(ts, ts[1:]) if b <= sent]
    for t in threads:
        t.join(timeout=10)
    time.sleep(0.3)  # the server frees the cancelled streams
    return ttft, gaps, before

def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p / 100 * len(v)))] if v else float("nan")

def metrics(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    out = {}
    for line in c.getresponse().read().decode().splitlines():
        if line.startswith(("colibri_step_cost", "colibri_prefill_chunks_",
                            "colibri_prefill_chunk_tokens_sum", "colibri_prefill_chunk_tokens_count")):
            name, value = line.split()
            out[name] = float(value)
    return out

for label in ports:  # warm-up: one round each, not counted
    one_round(ports[label], 1, 1000)
print(f"prefill_itl_bench: {cpu} | np {np} | prompt {tokens} tokens | --max-itl-ms {itl_ms} | "
      f"{rounds} interleaved rounds | load average {load}")
rows = []
for n in stream_counts:
    res = {label: [] for label in ports}
    for k in range(rounds):
        for label in ports:
            ttft, gaps, before = one_round(ports[label], n, k)
            res[label].append((ttft, pct(gaps, 50), pct(gaps, 99), len(gaps), pct(before, 50)))
    for label in ports:
        v = res[label]
        row = {"bench": "prefill_itl", "streams": n, "server": label,
               "itl_bound_ms": itl_ms if label == "bound" else 0, "prompt_tokens": tokens,
               "ttft_ms": statistics.median(x[0] for x in v) * 1e3,
               "ttft_ms_min": min(x[0] for x in v) * 1e3, "ttft_ms_max": max(x[0] for x in v) * 1e3,
               "itl_p50_ms": statistics.median(x[1] for x in v) * 1e3,
               "itl_p99_ms": statistics.median(x[2] for x in v) * 1e3,
               "itl_p99_ms_max": max(x[2] for x in v) * 1e3,
               "gaps_per_round": statistics.median(x[3] for x in v),
               "decode_itl_p50_ms": statistics.median(x[4] for x in v) * 1e3, "rounds": rounds, "np": np,
               "cpu": cpu}
        rows.append(row)
        print(f"streams {n}  {label:5s}  TTFT {row['ttft_ms']:8.1f} ms (min {row['ttft_ms_min']:.1f}, "
              f"max {row['ttft_ms_max']:.1f})  ITL while it prefills: p50 {row['itl_p50_ms']:7.2f} ms, "
              f"p99 {row['itl_p99_ms']:7.2f} ms (max over rounds {row['itl_p99_ms_max']:.2f}), "
              f"{row['gaps_per_round']:.0f} gaps a round; before it p50 {row['decode_itl_p50_ms']:.2f} ms")
for label in ports:
    m = metrics(ports[label])
    chunks = m.get("colibri_prefill_chunk_tokens_count", 0)
    print(f"{label:5s} step cost: {m.get('colibri_step_cost_fixed_seconds', 0) * 1e3:.3f} ms a call + "
          f"{m.get('colibri_step_cost_row_seconds', 0) * 1e3:.4f} ms a row + "
          f"{m.get('colibri_step_cost_kilokey_seconds', 0) * 1e3:.4f} ms per 1000 keys "
          f"(mean abs error {m.get('colibri_step_cost_mean_abs_error_seconds', 0) * 1e3:.3f} ms over "
          f"{m.get('colibri_step_cost_observations', 0):.0f} calls); prompt rows a call "
          f"{m.get('colibri_prefill_chunk_tokens_sum', 0) / max(chunks, 1):.1f} over {chunks:.0f} calls, "
          f"{m.get('colibri_prefill_chunks_cut_total', 0):.0f} cut, "
          f"{m.get('colibri_prefill_chunks_over_bound_total', 0):.0f} of them over the bound with the least rows")
for row in rows:
    print(json.dumps(row))
PY
