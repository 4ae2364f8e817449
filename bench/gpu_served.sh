#!/usr/bin/env bash
# The served benchmark (bench/served.py) on the H200 test machine, one part of its grid per call (the whole grid
# does not fit in one 10-minute call). Stage first, back to back (the machine forgets everything once idle):
#
#   bash bench/gpu_stage_ray.sh            # here: .device/stage-1..N (the model, Ray and Pulse's dependencies)
#   call 1: bash bench/gpu_build_llama.sh   carrying .llama (llama-server with CUDA, ~4 min in the background)
#   calls 2..N+1: bash .device/stage-K/unpack.sh   carrying .device/stage-K, the last one with .devcache
#   then:  bash bench/gpu_served.sh story   (or code, json), each call carrying nothing more
#   (or, so that uncommitted edits stay here: bash bench/gpu_clean_copy.sh, carry .device/clean, and run
#    `cd .device/clean && bash bench/gpu_served.sh story`: the result then names the archived commit)
#
# Each part runs pulse (adaptive speculation), pulse-k0 (speculation off) and llama-server direct at 1/8/32/64
# clients, greedy and temperature 1, interleaved; every run lands in $OUT/records.jsonl as it finishes, and the
# summary (JSON, table, PNG) when the part ends. SERVED_ARGS overrides the repeats and sizes, TARGETS the targets,
# PROFILE the device profile (h200 unless given; cuda on an H100 machine, as `pulse serve` picks there).
# The JSON-schema part: llama-server direct is slow there (2026-12-02 on the H200: 118 tok/s at 32 clients, all 64
# of its 64-client requests past a 60 s timeout, so the warm-up round alone took the call's 240 s); keep --timeout
# short and the repeats few so that the call ends with a table:
#   BENCH_TIMEOUT_S=540 SERVED_ARGS="--clients 1 8 32 64 --tokens 128 --per-client 1 --repeats 2 --warmup 1
#     --duration 15 --timeout 20" bash bench/gpu_served.sh json
# The sweep past 64 clients with the engine alone beside it (issue 25), one call, at the profile's batch (without
# --profile-batch the engine runs max_num_seqs = the largest client count, 1,000: not what `pulse serve` runs):
#   TARGETS=pulse SERVED_ARGS="--clients 1 16 64 128 256 512 1000 --sampling greedy t1 --per-client 4 --repeats 2
#     --warmup 1 --duration 40 --timeout 90 --engine-alone --profile-batch --client-procs 4" BENCH_TIMEOUT_S=575
#     bash bench/gpu_served.sh story
# Mixed steps (prompt chunks replaying the verify graphs) against the same server with them off, arrivals spread as
# independent agents' are (without --stagger closed-loop clients re-arrive together and few steps carry a prompt):
#   TARGETS="pulse pulse-eager" SERVED_ARGS="--clients 64 256 --per-client 6 --stagger 1 --repeats 2 --warmup 1
#     --duration 60 --timeout 120 --profile-batch --engine-alone" bash bench/gpu_served.sh story
# The worker's own queue past saturation (the h200 profile's worker_queue 128 against a queue of 4; issue 25):
#   TARGETS="pulse pulse-q4" SERVED_ARGS="--clients 256 512 1000 --sampling t1 --per-client 4 --repeats 2
#     --warmup 1 --duration 40 --timeout 90 --profile-batch --client-procs 4" BENCH_TIMEOUT_S=320
#     bash bench/gpu_served.sh story
# The engine process's garbage collection, Python's defaults (pulse) against workers.engine.quiet_gc on (pulse-qgc),
# past saturation (issue 25; on a freshly started machine the first server's start also compiles the kernels, so
# leave ~3 min for the two starts; 2026-12-04 the call took 321 s with the stages unpacked in it):
#   TARGETS="pulse pulse-qgc" SERVED_ARGS="--clients 256 1000 --sampling greedy t1 --per-client 4 --repeats 2
#     --warmup 1 --duration 40 --timeout 90 --profile-batch --client-procs 4" BENCH_TIMEOUT_S=480
#     bash bench/gpu_served.sh story
# Two engines sharing the GPU (pulse-w2: workers.count 2, each its own engine process) against one, where the served
# full-batch step is the engine's host work (2026-12-04: waiting on the device 3% of the step at 256 clients); the
# per-run lines print the step threads' time by part (busy, waiting on the device, schedule, build, forward, ...):
#   TARGETS="pulse pulse-w2" SERVED_ARGS="--clients 64 256 1000 --sampling greedy t1 --per-client 4 --repeats 2
#     --warmup 1 --duration 30 --timeout 90 --profile-batch --client-procs 4" BENCH_TIMEOUT_S=560
#     bash bench/gpu_served.sh story
# The attention kernel's variants alone and served: bench/gpu_attention.sh, then pulse-att with BENCH_ATT_VARIANT.
# A change against the commit before it, served in the same repeats (pulse-base: that commit's tree, archived beside
# this one by `BASE=REV bash bench/gpu_clean_copy.sh` into .device/clean/.base), e.g. the engine's host work a step:
#   TARGETS="pulse pulse-base" SERVED_ARGS="--clients 256 1000 --sampling greedy t1 --per-client 4 --repeats 2
#     --warmup 1 --duration 30 --timeout 90 --profile-batch --client-procs 4" BENCH_TIMEOUT_S=480
#     bash bench/gpu_served.sh story
# A profile against the one the machine got before (issue 25 on an H100: the h100 profile of c381a30 against the cuda
# profile that 8864879 picks there), each server picking its own (PROFILE set and empty; engine alone not comparable):
#   BASE=8864879 bash bench/gpu_clean_copy.sh; then PROFILE= TARGETS="pulse pulse-base" SERVED_ARGS="--clients 64 128
#     256 1000 --sampling greedy t1 --per-client 4 --repeats 2 --warmup 1 --duration 40 --timeout 90 --profile-batch
#     --client-procs 4" BENCH_TIMEOUT_S=560 bash bench/gpu_served.sh story
set -u
workload=${1:-story}
source "$(dirname "$0")/gpu_env.sh"
res=/tmp/served-$workload-$(date +%s)  # one folder per call: several calls share the machine
mkdir -p "$res"
targets=${TARGETS:-pulse pulse-k0 llama}
if [[ $targets == *llama* ]] && ! llama_built; then
  echo "no llama-server build: Pulse only"; targets=${targets/llama/}
fi
# SIGINT at the limit: bench/served.py stops its servers and still summarizes the runs that ended (SIGKILL 40 s later)
# PROFILE set but empty: no --profile, each `pulse serve` picks its own (pulse-base's tree may lack the newer profile)
profile_args=(--profile "${PROFILE:-h200}")
[[ -v PROFILE && -z $PROFILE ]] && profile_args=()
timeout --signal=INT -k 40 "${BENCH_TIMEOUT_S:-540}" python3 -m bench.served --model "$model" --llama-server /root/lb/build/bin/llama-server \
  --device cuda "${profile_args[@]}" --targets $targets --workloads "$workload" --out "$res" --quiet \
  ${SERVED_ARGS:---clients 1 8 32 64 --tokens 128 --per-client 1 --repeats 3 --warmup 1 --duration 15 --timeout 60} \
  2>&1 | tail -40
python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1
cp "$res"/served-logs-*/records.jsonl "${OUT:-/tmp}/records-$workload.jsonl" 2>/dev/null
cp "$res"/served-logs-*/engine_alone.json "${OUT:-/tmp}/engine_alone-$workload.json" 2>/dev/null
cp "$res"/served-*.json "$res"/served-*.md "$res"/served-*.png "${OUT:-/tmp}/" 2>/dev/null
