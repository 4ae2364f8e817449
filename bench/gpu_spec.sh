#!/usr/bin/env bash
# Speculative decoding on the H200 test machine in one call (issue 4), after the model was staged with
# ../shared/tools/device-pack (five stages; the last one carried together with .whl and .devcache):
#
#   bash bench/gpu_spec.sh [tests] [edit] [grid]     # default: all three; results in $OUT/spec_results.tgz
#
# tests: pytest tests/gpu (GPU == CPU, verify graphs == CPU, lossless speculation on the real model)
# edit:  python -m bench.speculation edit  (batch-1 code edits: none / lookup / predicted, interleaved)
# grid:  python -m bench.speculation grid  (context x concurrency x K, adaptive policy beside fixed K)
# chat:  the same grid over open questions (little for prompt lookup to find)
# GRID_ARGS / EDIT_ARGS override the defaults below; PROFILE names the adaptive policy's profile.
set -u
home=${PULSE_DEVICE_HOME:-/root/pulse-device}
model=$home/model/gemma-3-270m-q4_k_m.gguf
res=/tmp/spec-results
mkdir -p "$res" "$home/site"
export PYTHONPATH=$home/site:$PWD PYTHONUNBUFFERED=1 PULSE_CACHE_DIR=${PULSE_CACHE_DIR:-/root/pulse-cache}
export PULSE_GGUF=$model
# pydantic & co. (the machine's image lacks them) and the derived tokenizer/info (the model's cache key is
# path + size + mtime, so the mtime is pinned to the one they were derived under)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$home/site" .whl/*.whl
fi
touch -d @1700000000 "$model"
mkdir -p "$PULSE_CACHE_DIR" && tar xJf .devcache/derived.tar.xz -C "$PULSE_CACHE_DIR"
parts=${*:-tests edit grid}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
for part in $parts; do
  case $part in
    tests) python3 -m pytest tests/gpu -q -p no:cacheprovider -W ignore 2>&1 | tee "$res/gpu_tests.log" | tail -12 ;;
    edit) python3 -m bench.speculation edit --device cuda --model "$model" --out "$res" --quiet \
            ${EDIT_ARGS:---tokens 128 --repeats 5 --warmup 2} ${PROFILE:+--profile $PROFILE} 2>&1 | tail -25 ;;
    grid) python3 -m bench.speculation grid --device cuda --model "$model" --out "$res" --quiet \
            ${GRID_ARGS:---contexts 512 4096 16384 --concurrency 1 4 16 32 --ks 4 8 --tokens 96 --repeats 5 --warmup 1} \
            ${PROFILE:+--profile $PROFILE} 2>&1 | tail -16 ;;
    chat) python3 -m bench.speculation grid --workload chat --device cuda --model "$model" --out "$res" --quiet \
            ${CHAT_ARGS:---contexts 512 4096 --concurrency 1 16 --ks 4 8 --tokens 96 --repeats 5 --warmup 1} \
            ${PROFILE:+--profile $PROFILE} 2>&1 | tail -10 ;;
  esac
done
rm -f "$res"/*.png
tar czf "${OUT:-/tmp}/spec_results.tgz" -C "$res" .
