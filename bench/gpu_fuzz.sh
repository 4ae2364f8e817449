#!/usr/bin/env bash
# The real backends' fuzz at full count on the H200 test machine (bench/fuzz_shards.py: one `pulse serve`, the
# fuzz module in several processes against it), after the same staging as bench/gpu_served.sh. One backend a
# call (the machine's 10-minute limit):
#   FUZZ_ARGS="--examples 5000 --shards 8" bash bench/gpu_fuzz.sh cupy           # 10,000 requests
#   FUZZ_ARGS="--examples 5000 --shards 8" bash bench/gpu_fuzz.sh llama-server   # needs bench/gpu_build_llama.sh
# (FUZZ_ARGS="... --only chat" and then "--only completions": one endpoint a call, where both do not fit)
set -u
backend=${1:-cupy}
source "$(dirname "$0")/gpu_env.sh"
res=/tmp/fuzz-$backend-$(date +%s)
mkdir -p "$res"
extra=()
[[ $backend == llama-server ]] && extra=(--binary /root/lb/build/bin/llama-server)
timeout "${BENCH_TIMEOUT_S:-560}" python3 -m bench.fuzz_shards --backend "$backend" --model "$model" --device auto \
  "${extra[@]}" --out "$res" ${FUZZ_ARGS:---examples 5000 --shards 8} 2>&1 | tail -20
python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1
mkdir -p "${OUT:-/tmp}/fuzz-$backend"
cp -r "$res"/* "${OUT:-/tmp}/fuzz-$backend/" 2>/dev/null
