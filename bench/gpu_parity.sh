#!/usr/bin/env bash
# bench/llama_server_parity.py on the H200 test machine (issue 18): `pulse serve --backend llama-server` against the
# same llama-server called directly, with the CUDA build of the pinned llama.cpp. Stage first, back to back (the
# machine forgets everything once idle): `bash bench/gpu_build_llama.sh` carrying .llama (the build runs ~8 min in the
# background while the stages unpack), bench/gpu_stage_ray.sh's stages, the last one with .device/clean
# (`bash bench/gpu_clean_copy.sh`), then:
#   cd .device/clean && bash bench/gpu_parity.sh
#   PARITY_ARGS="--clients 8 32 64 --modes greedy --think-ms 0 50 ..." bash bench/gpu_parity.sh
#   # the patched build (deploy/llama_patches/) against llama.cpp as released, same flags:
#   PARITY_ARGS="--clients 1 8 --variants '' '' --variant-binaries '' /root/lb/released/llama-server-released" ...
# On a GPU other than the H200 (the cuda profile: 16 slots, the RAM prompt cache on) the h200 profile's llama-server
# settings are set explicitly: 64 slots, SERVER_ARGS="--cache-ram 0 --backend-sampling" (later flags win).
# KV sets llama-server's -c (default 65536, as every parity figure so far ran); KV= (empty) leaves the profile's
# kv_cache_tokens, as `pulse serve` ships it (the h200 profile: 1,048,576). SHIPPED=1 runs the machine's own
# profile as `pulse serve` ships it (on an H100: the cuda profile, 16 slots, its -c and flags), KV= implied.
# It waits for the build (up to 6 min), runs the bench under T seconds (default: what is left of 560 s after the
# wait, so that the call's 600 s still bring the results back; SIGINT at the limit still summarizes the runs that
# ended), and leaves in $OUT the table, the JSON and one tarball of the logs
# (llama-server's own, with timestamps, and Pulse's).
set -u
source "$(dirname "$0")/gpu_env.sh"
t0=$SECONDS
if ! llama_built; then
  echo "no llama-server build (build.rc: $(cat /root/lb/build.rc 2>/dev/null || echo none))"
  tail -20 /root/lb/build.log 2>/dev/null; exit 1
fi
uptime
T=${T:-$((560 - (SECONDS - t0)))}
d=/tmp/parity-$(date +%s)
sa=()
[[ -n ${SHIPPED:-} ]] || nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 ||
  sa=(--slots 64 --server-args="${SERVER_ARGS:---cache-ram 0 --backend-sampling}")
[[ -n ${SERVER_ARGS:-} && ${#sa[@]} -eq 0 ]] && sa=(--server-args="$SERVER_ARGS")
[[ -n ${SHIPPED:-} ]] && KV=${KV-}
KV=${KV-65536}
[[ -n $KV ]] && sa+=(--kv-tokens "$KV")
# PARITY_ARGS is read as shell words, so a quoted variant keeps its spaces
eval "pa=(${PARITY_ARGS:---clients 1 8 32 64 --modes greedy t1exact --tokens 128 --requests-per-client 2 --repeats 2 \
  --warmup 1})"
timeout --signal=INT -k 20 "$T" python3 -m bench.llama_server_parity --model "$model" \
  --binary /root/lb/build/bin/llama-server --apis completions --queue-deadline 600 \
  --out "$d" --quiet "${sa[@]}" "${pa[@]}"
uptime
python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1
cp "$d"/*.md "$d"/*.json "${OUT:-/tmp}/" 2>/dev/null
tar czf "${OUT:-/tmp}/parity-logs.tgz" -C "$d" . 2>/dev/null
