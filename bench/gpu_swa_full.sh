#!/usr/bin/env bash
# bench/llama_swa_full.py on the GPU machine (issue 18): the CUDA build of the pinned llama.cpp with the h200
# profile's llama-server flags (64 slots, -c 65536, one KV pool), with and without --swa-full. Needs no Ray: the
# build (`bash bench/gpu_build_llama.sh` carrying .llama), the model, and .device/clean. The model's pieces are in
# stages 2-6 of bench/gpu_stage_ray.sh's and stage 7's unpack joins them (it also installs wheels, some from stage 1:
# without stage 1 it stops first, so then join the parts yourself:
# `cat /root/pulse-device/model/*.part0[0-3] > /root/pulse-device/model/gemma-3-270m-q4_k_m.gguf`), then:
#   cd .device/clean && bash bench/gpu_swa_full.sh
# SWA_ARGS replaces the bench's own arguments. Leaves the table, the JSON and llama-server's log in $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
if ! llama_built; then
  echo "no llama-server build (build.rc: $(cat /root/lb/build.rc 2>/dev/null || echo none))"
  tail -20 /root/lb/build.log 2>/dev/null; exit 1
fi
uptime
out=${OUT:-/tmp}
eval "sa=(${SWA_ARGS:---contexts 32 512 4000 16000 32000 --clients 8 32 --tokens 64 --turns 3 --rounds 3 --repeats 3})"
# the h200 profile's llama-server flags as Pulse passes them (flags.server_argv's pool flags first), but -c 65536 as
# bench/gpu_parity.sh runs it, and without --swa-full: the bench's variants add it or not
pa=$(python3 -c "from policy.profiles import builtin_profiles as b
print(' '.join(a for a in b()['h200'].llama_server_args if a != '--swa-full'))")
timeout --signal=INT -k 20 "${T:-540}" python3 -m bench.llama_swa_full --binary /root/lb/build/bin/llama-server \
  --model "$model" --args "-np 64 -c 65536 --kv-unified --no-cache-idle-slots $pa" --json "$out/swa_full.json" \
  --log-dir /tmp/swa_full-logs "${sa[@]}" | tee "$out/swa_full.md"
tar czf "$out/swa_full-logs.tgz" -C /tmp swa_full-logs 2>/dev/null
uptime
