#!/usr/bin/env bash
# The routing comparison (issue 6) on the H200 test machine: four `pulse serve` of 4 CuPy engine workers each,
# all sharing the one GPU (0.25 of it per worker), replaying an agent trace. The machine has no Ray and no
# network, so Ray, Ray Serve and Pulse's other dependencies come as wheels: stage them with
#
#   bash bench/gpu_stage_ray.sh      # the model + the whole resolved dependency set but numpy, ~7 stages
#
# carry the stages one per call, back to back, the last one with .devcache (the derived tokenizer), and in
# that last call:
#
#   bash bench/gpu_routing.sh [bench.routing arguments...]      # results in $OUT/routing_results.tgz
#
# The longer trace (14 turns, ~2-15.6k-token prompts, KV for about three final contexts a worker):
#
#   bash bench/gpu_routing.sh --sessions 8 --turns 14 --system-words 1500 --tool-words 500 1100 \
#       --kv-blocks 3000 --max-num-seqs 8 --max-tokens 4 --repeats 5 --warmup 1 --stagger 2 --start-timeout 240
#
# Default arguments: an agent trace with long contexts (a ~2k-token system prompt, tool output of 300-900
# words a turn, 10 turns: ~2-9k-token prompts) and KV for about three final contexts per worker, as the CPU
# run sizes it (BENCHMARKS.md, routing).
set -u
source "$(dirname "$0")/gpu_env.sh"
res=/tmp/routing-results
mkdir -p "$res"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
python3 -c 'import ray, ray.serve, cupy; print("ray", ray.__version__, "cupy", cupy.__version__)' || exit 3
args=("$@")
if [[ ${#args[@]} -eq 0 ]]; then
  args=(--sessions 8 --turns 10 --system-words 1500 --tool-words 300 900 --kv-blocks 1536 --max-num-seqs 8
        --max-tokens 4 --repeats 5 --warmup 1 --stagger 2 --start-timeout 240)
fi
( while sleep 20; do nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; done ) \
  > "$res/nvidia-smi.log" 2>&1 &
watch=$!
# whether the host's cores are saturated (what the gateway's decision wall time waits on): load, the busiest
# processes and the CPU counters (/proc/stat's 8th number is steal: time the VM's vCPUs were not run) every 20 s
( while sleep 20; do date +%T; cat /proc/loadavg; head -1 /proc/stat; ps -eo pcpu,rss,comm --sort=-pcpu | head -12; done ) \
  > "$res/cpu.log" 2>&1 &
cpuwatch=$!
timeout "${BENCH_TIMEOUT_S:-520}" python3 -m bench.routing --device cuda --model "$model" --out "$res" --quiet \
  "${args[@]}" 2>&1 | tail -40
echo "bench rc=${PIPESTATUS[0]}"
kill $watch $cpuwatch 2>/dev/null
python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1
tail -3 "$res/nvidia-smi.log"; grep -A3 "^[0-9]*:[0-9]*:[0-9]*$" "$res/cpu.log" | tail -8
tar czf "${OUT:-/tmp}/routing_results.tgz" -C "$res" .
