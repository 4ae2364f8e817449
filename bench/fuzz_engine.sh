#!/usr/bin/env bash
# The real backends' input handling fuzzed at full count through HTTP: tests/integration/test_fuzz_engine.py
# with N generated requests per endpoint (chat, completions) and backend (Pulse's engine on the CPU, a
# managed llama-server): 4 x N in all, so the default N=2500 is 10,000 requests. Zero 5xx, zero hangs and
# every stream ended are what pass; RELIABILITY.md has the last figures.
#   bash bench/fuzz_engine.sh [N]
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-2500}"
# pytest's per-test timeout (pyproject) is for CI sizes; this run allows ~2 s a request
PULSE_ENGINE_FUZZ_EXAMPLES="$N" exec python3 -m pytest tests/integration/test_fuzz_engine.py -q -p no:cacheprovider \
  --timeout=$((N * 2 + 300)) --durations=4 --hypothesis-show-statistics
