#!/usr/bin/env bash
# bench/gateway_overhead.py on the H200 test machine's host (16 cores; the GPU unused: the load-test backend), for
# issue 20's "both boxes". Stage first (bench/gpu_stage_ray.sh's stages: Ray and the serving stack), then from a
# clean copy (`BASE=REV bash bench/gpu_clean_copy.sh`: REV's tree in .base is the second Pulse target):
#   cd .device/clean && bash bench/gpu_gateway.sh fast   # 1 and 32 clients, this tree against .base, 5 repeats
#   cd .device/clean && bash bench/gpu_gateway.sh held   # 256 and 1,000 held streams (4 tokens/s), against .base
#   B_TREE=. B_ARGS="--gateway-replicas 1" bash bench/gpu_gateway.sh fast   # this tree, 1 replica as the second
#   cd .device/clean && bash bench/gpu_gateway.sh idle   # bench/idle_cpu.py: idle CPU and RSS by process, this tree
#   A_ARGS="--gateway-replicas 2" B_TREE=. bash bench/gpu_gateway.sh held   # A_ARGS: added to the first target's
#                                                                  # command; 2 replicas against the default, interleaved
# REPEATS sets the measured repeats (default 5 fast, 2 held: ~190 s at 2, ~60 s a repeat more).
# T bounds the bench in seconds (default 400); the table, the JSON and a tarball of the logs land in $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
uptime
PC="python3 -m pulse.cli serve --backend loadtest --model $model --host 127.0.0.1 --port {port} --config {config} ${A_ARGS:-}"
# the second target: .base's tree (B_TREE=. for this one), with B_ARGS added (e.g. "--gateway-replicas 1")
bt=$PWD/${B_TREE:-.base}
PB="sh -c 'cd $bt && PYTHONPATH=$home/site:$bt exec python3 -m pulse.cli serve --backend loadtest \
--model $model --host 127.0.0.1 --port {port} --config {config} ${B_ARGS:-}'"
d=/tmp/gw-${1:-fast}-$(date +%s)
b=(); [[ -d $bt ]] && b=(--pulse-b-cmd "$PB")
if [[ ${1:-fast} == idle ]]; then
  # what `pulse serve` (the default replicas, the one model) holds and spends while it serves nothing, by process
  printf 'model: {name: gemma-3-270m, path: %s}\n' "$model" > /tmp/gw-idle.yaml
  timeout --signal=INT -k 30 "${T:-400}" python3 -m bench.idle_cpu --config /tmp/gw-idle.yaml --repeats ${REPEATS:-3} \
    --warmup 0 --seconds 15 --settle 5 --out "$d" --quiet
elif [[ ${1:-fast} == fast ]]; then
  timeout --signal=INT -k 30 "${T:-400}" python3 -m bench.gateway_overhead --clients 1 32 --repeats ${REPEATS:-5} --warmup 1 \
    --duration 3 --pulse-cmd "$PC" "${b[@]}" --out "$d" --quiet
else
  timeout --signal=INT -k 30 "${T:-400}" python3 -m bench.gateway_overhead --clients 256 1000 --rate 4 --repeats ${REPEATS:-2} \
    --warmup 1 --duration 6 --pulse-cmd "$PC" "${b[@]}" --out "$d" --quiet
fi
uptime
python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1
cp "$d"/*.md "$d"/*.json "${OUT:-/tmp}/" 2>/dev/null
tar czf "${OUT:-/tmp}/gw-${1:-fast}-logs.tgz" -C "$d" . 2>/dev/null
