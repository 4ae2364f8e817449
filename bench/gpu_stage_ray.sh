#!/usr/bin/env bash
# Stage the model plus Ray, Ray Serve and Pulse's other runtime dependencies for the GPU machine (Python 3.12,
# no network, no Ray), for bench/gpu_routing.sh:
#
#   bash bench/gpu_stage_ray.sh            # writes .device/stage-1..N (about 7), then carry them as it prints
#
# Resolves the whole dependency set for CPython 3.12 on x86-64 (manylinux 2.31 included, which llguidance
# needs), leaves out numpy (the machine's own, which its CuPy and PyTorch are built against) and hands the
# exact pins to ../shared/tools/device-pack, run from a copy that also accepts manylinux_2_31 wheels.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
pack=${DEVICE_PACK:-$here/../shared/tools/device-pack}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
plat=(--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d "$work/wheels" "ray[serve]>=2.60,<2.61" "msgspec>=0.18" "redis>=5" "gguf>=0.10" "llguidance==1.9.1" \
  "opentelemetry-api>=1.25" "opentelemetry-sdk>=1.25" "opentelemetry-exporter-otlp>=1.25" "pydantic>=2.7" \
  "threadpoolctl>=3.1" "xxhash>=3.4" "cachetools>=5.3" "tqdm>=4.66" pytest-asyncio 2>&1 | grep -v "is ignored" || true
pins=$(cd "$work/wheels" && ls *.whl | grep -v '^numpy-' | awk -F- '{print $1 "==" $2}' | tr '\n' ' ')
echo "$(echo "$pins" | wc -w) wheels"
sed 's/--platform manylinux_2_28_x86_64/--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64/' \
  "$pack" > "$work/device-pack"
bash "$work/device-pack" --wheels "$pins" --out "$here/.device"
echo "then, back to back: run 'bash .device/stage-K/unpack.sh' carrying .device/stage-K for K = 1..N-1, and"
echo "'bash .device/stage-N/unpack.sh && bash bench/gpu_routing.sh' carrying .device/stage-N and .devcache"
