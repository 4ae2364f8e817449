#!/usr/bin/env bash
# The GPU comparison, run on the H200 test machine in one call, after the model was staged with
# ../shared/tools/device-pack and llama.cpp was built there (bench/gpu_build_llama.sh):
#
#   ROUNDS=5 bash bench/gpu_session.sh          # writes $OUT/gpu_bench.json, prints the table
#   MODEL=SmolLM2-135M-Instruct.Q4_1.gguf ROUNDS=5 bash bench/gpu_session.sh   # -> $OUT/gpu_bench_<stem>.json
#
# MODEL: a GGUF path, or a file name under $PULSE_DEVICE_HOME/model (default: the bundled Gemma 3 270M Q4_K_M);
# the same file goes to Pulse's bench and to llama.cpp's. Each model keeps its own results folder.
#
# Protocol (METHOD.md): one discarded warm-up round, then ROUNDS rounds, each running Pulse's bench
# (bench/engine_gpu.py: 3 repeats of every case after its own warm-up), llama-bench (pp512 / tg128, -r 3, its
# own warm-up) and llama-batched-bench (-npp 128 -ntg 128 -npl 1,64), interleaved; same GGUF, same GPU, flash
# attention on for llama.cpp. Medians and min/max over all samples.
set -u
home=${PULSE_DEVICE_HOME:-/root/pulse-device}
model=${MODEL:-gemma-3-270m-q4_k_m.gguf}
[[ $model == */* ]] || model=$home/model/$model
[[ -f $model ]] || { echo "no GGUF at $model" >&2; exit 1; }
stem=$(basename "$model" .gguf)
bin=${LLAMA_BIN:-/root/lb/build/bin}
rounds=${ROUNDS:-5}
res=/tmp/pulse-bench/$stem
out_json=${OUT:-/tmp}/gpu_bench${MODEL:+_$stem}.json
mkdir -p "$res"
rm -f "$res"/pulse_* "$res"/lb_* "$res"/lbb_*  # a failed case must not be summarised from an earlier call's files
echo "model: $model"
export PYTHONPATH=$home/site:$PWD PYTHONUNBUFFERED=1 PULSE_CACHE_DIR=${PULSE_CACHE_DIR:-/root/pulse-cache}

# wait for a build bench/gpu_build_llama.sh started (up to 10 min), unless both benches are already there
for i in $(seq 1 150); do
  [[ -f /root/lb/build.rc || ( -x $bin/llama-bench && -x $bin/llama-batched-bench ) ]] && break; sleep 4
done
echo "llama.cpp build rc: $(cat /root/lb/build.rc 2>/dev/null || echo 'not finished')"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader

# the SM clock through the run (METHOD.md: measure the card as found; note its state)
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu --format=csv,noheader -lms 200 \
  > "$res/smi.csv" 2>&1 &
smi=$!
for r in $(seq 0 "$rounds"); do
  python3 -m bench.engine_gpu --model "$model" --repeats 3 --json "$res/pulse_$r.json" > "$res/pulse_$r.log" 2>&1 \
    || tail -5 "$res/pulse_$r.log"
  "$bin/llama-bench" -m "$model" -ngl 99 -fa 1 -p 512 -n 128 -r 3 -o json > "$res/lb_$r.json" 2> "$res/lb_$r.err" \
    || tail -5 "$res/lb_$r.err"
  "$bin/llama-batched-bench" -m "$model" -ngl 99 -fa on -c 40960 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 1,64 \
    --output-format jsonl > "$res/lbb_$r.jsonl" 2> "$res/lbb_$r.err" || tail -5 "$res/lbb_$r.err"
  echo "round $r done"
done
kill "$smi"
echo "SM clock samples (MHz: count):"; cut -d, -f2 "$res/smi.csv" | sort | uniq -c | sort -rn | head -5
python3 bench/gpu_summary.py "$res" "$rounds" "$out_json"
