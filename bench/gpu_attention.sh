#!/usr/bin/env bash
# The attention kernel's variants on the H200 test machine (issue 25), in one call after staging (bench/gpu_served.sh's
# header: stage-1..N unpacked back to back, the last call carrying .device/stage-N and .device/clean):
#   cd .device/clean && bash bench/gpu_attention.sh "" "MIN_BLOCKS=2 UNROLL=2" "XRED=1"
# Each argument is one variant (PULSE_GPU_ATT_* settings without the prefix; "" the defaults): its device time
# alone at 64/128/256 sequences and 128/512 tokens of context (bench/attention_gpu.py, table and JSON in $OUT), then
# the kernel tests (tests/gpu/test_kernels.py's attention cases against the NumPy engine) compiled as each variant.
# ATT_NCU=1 adds Nsight Compute's view of the first variant at 256 sequences where ncu exists. The fastest variant
# that passed is written to ATT_BEST for the served calls after (BENCH_ATT_VARIANT=$(cat /tmp/att_best)).
set -u
home=${PULSE_DEVICE_HOME:-/root/pulse-device}
export PYTHONPATH=$home/site:$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
variant_env() {  # "MIN_BLOCKS=2 UNROLL=2" -> "PULSE_GPU_ATT_MIN_BLOCKS=2 PULSE_GPU_ATT_UNROLL=2" (served.py att_env)
  python3 -c "import sys; from bench.served import att_env
print(' '.join(f'{k}={v}' for k, v in att_env(sys.argv[1]).items()))" "$1"
}
python3 -m bench.attention_gpu --batches ${ATT_BATCHES:-64 128 256} --ctx ${ATT_CTX:-128 512} --variants "$@" \
  --json "$out/attention_gpu.json" 2>&1 | tee "$out/attention_gpu.txt" | tail -60
: > "$out/attention_passed.txt"
for v in "$@"; do
  env_v=$(variant_env "$v")
  echo "== tests, variant '${v}'"
  env $env_v timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_kernels.py -k attention \
    > "$out/tests.log" 2>&1 && echo "$v" >> "$out/attention_passed.txt"
  tail -3 "$out/tests.log"
done
# the variant whose device time, against the first's, has the lowest geometric mean over the cases, among those
# whose tests passed: to ATT_BEST (default /tmp/att_best) for the calls after this one (bench/served.py's pulse-att)
python3 - "$out/attention_gpu.json" "$out/attention_passed.txt" "${ATT_BEST:-/tmp/att_best}" <<'PY'
import json, math, sys
rows = json.load(open(sys.argv[1]))["rows"]
passed = {line.rstrip("\n") or "defaults" for line in open(sys.argv[2])}
base = {(r["batch"], r["ctx"]): r["us"] for r in rows if r["variant"] == rows[0]["variant"]}
score = {}
for r in rows:
    score.setdefault(r["variant"], []).append(math.log(r["us"] / base[(r["batch"], r["ctx"])]))
ranked = sorted((math.exp(sum(v) / len(v)), k) for k, v in score.items() if k in passed)
for g, k in ranked:
    print(f"geomean vs {rows[0]['variant']}: {g:.3f}  {k}")
open(sys.argv[3], "w").write("" if not ranked or ranked[0][1] == "defaults" else ranked[0][1])
PY
if [[ ${ATT_NCU:-0} == 1 ]] && command -v ncu >/dev/null; then
  env_v=$(variant_env "${1:-}")
  env $env_v timeout 180 ncu --kernel-name attention --launch-skip 30 --launch-count 1 --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section LaunchStats python3 -m bench.attention_gpu --batches 256 \
    --ctx 128 --repeats 1 2>&1 | tail -80 | tee "$out/ncu.txt"
else
  echo "ncu: $(command -v ncu || echo absent)"
fi
