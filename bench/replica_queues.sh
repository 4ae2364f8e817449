#!/usr/bin/env bash
# Admission past saturation with several gateway replicas (issue 25's 429s at 1,000 clients), on any box, no GPU:
# `pulse serve --backend loadtest` whose backend meets admission as an engine does (a batch of 256 generating, the
# rest waiting inside it, 128 places said: workers/loadtest.py `batch`, `worker_queue`), REPLICAS gateway replicas,
# and CLIENTS closed-loop clients x PER requests from 2 load-generator processes (bench/loadgen.py), ROUNDS rounds a
# server. With TREE_B (another checkout, e.g. a `git worktree` of an older commit) the two trees alternate, RUNS
# times each, every run a fresh server. One table row a round: requests, answered, 429s, req/s, TTFT p50/p99 (ms),
# and why the refused were refused (bench/loadgen.py's `refusals`).
#   bash bench/replica_queues.sh                         # this tree
#   TREE_B=/tmp/wt-old RUNS=3 bash bench/replica_queues.sh
#   BATCH=64 WQ=32 TOKENS=8 RATE=25 CLIENTS=400 PER=4 ROUNDS=2 RUNS=3 TREE_B=/tmp/wt-old bash bench/replica_queues.sh
#     (how full the places stay past saturation on 2 cores: a smaller batch, so that the box's gateways are not the
#     limit, and requests as short as the H200's; BATCH and WQ: the load-test backend's places and worker queue)
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
port=${PORT:-18431}
out=${OUT_DIR:-/tmp/replica-queues-$(date +%s)}
mkdir -p "$out"
echo "| tree | run | round | requests | ok | 429 | req/s | TTFT p50 / p99 ms | refusals |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for run in $(seq 1 "${RUNS:-1}"); do
  for tree in "$here" ${TREE_B:-}; do
    d=$out/run$run-$(basename "$tree"); mkdir -p "$d"
    cat > "$d/pulse.yaml" <<YAML
server: {port: $port, host: 127.0.0.1, gateway_replicas: ${REPLICAS:-4}}
workers:
  backend: loadtest
  count: 1
  loadtest: {tokens: ${TOKENS:-16}, tokens_per_s: ${RATE:-20}, batch: ${BATCH:-256}, worker_queue: ${WQ:-128}}
keys: {file: $d/keys.json}
telemetry: {log_level: WARNING}
YAML
    (cd "$tree" && PYTHONPATH=$tree exec python -m pulse.cli serve --config "$d/pulse.yaml") > "$d/serve.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 120); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 2; done
    model=$(curl -s "http://127.0.0.1:$port/v1/models" | python3 -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
    for r in $(seq 1 "${ROUNDS:-3}"); do
      (cd "$here" && python -m bench.loadgen --url "http://127.0.0.1:$port" --api completions --model "$model" \
        --max-tokens "${TOKENS:-16}" --clients "${CLIENTS:-1000}" --requests $(( ${CLIENTS:-1000} * ${PER:-4} )) \
        --duration 300 --timeout 120 --procs 2) > "$d/load-$r.json" 2> "$d/load-$r.err"
      python3 - "$d/load-$r.json" "$tree" "$run" "$r" <<'PY'
import json, sys
path, tree, run, rnd = sys.argv[1:]
d = json.load(open(path))
m = d["metrics"]
why = "; ".join(f"{n}x {k}" for k, n in d.get("refusals", {}).items()) or "-"
print(f"| {tree} | {run} | {rnd} | {m['requests']} | {m['ok']} | {m['rate_limited']} | {m['req_s']:.1f} | "
      f"{m['ttft_p50_ms']:.0f} / {m['ttft_p99_ms']:.0f} | {why} |")
PY
    done
    kill -INT "$pid"; sleep 8; kill -9 "$pid" 2>/dev/null
    python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1
  done
done
echo "logs: $out"
