#!/usr/bin/env bash
# Apply every patch in this folder, in name order, to the llama.cpp source tree SRC; exit 1 naming the first that
# does not apply (one applied already included: never reversed). `patch` where the machine has it, else
# `git apply` (a fresh CI image or the device may lack either).
#   bash deploy/llama_patches/apply.sh SRC
# Used by deploy/build_llama_server.sh and bench/gpu_build_llama.sh.
set -euo pipefail
src="$1"
for p in "$(cd "$(dirname "$0")" && pwd)"/*.patch; do
  [[ -e "$p" ]] || continue
  echo "applying $(basename "$p")"
  if command -v patch >/dev/null; then patch -p1 --forward --batch --quiet -d "$src" <"$p"; else git -C "$src" apply -p1 "$p"; fi ||
    { echo "$(basename "$p") does not apply to the llama.cpp source in $src" >&2; exit 1; }
done
