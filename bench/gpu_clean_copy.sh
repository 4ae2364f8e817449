#!/usr/bin/env bash
# The tree a GPU call runs from: a `git archive` of HEAD in .device/clean (ignored by git), with its commit in
# .device/clean/COMMIT (bench/machine.py reads it: the copy has no .git of its own, and the enclosing checkout's
# commit would be wrong), so that uncommitted edits in the working tree never reach the device. The derived
# files the device scripts need beside the tree (.devcache) come from .device/devcache (bench/gpu_stage_extra.sh),
# else from the previous copy.
#   bash bench/gpu_clean_copy.sh      # then carry .device/clean and run `cd .device/clean && bash bench/...`
#   BASE=REV bash bench/gpu_clean_copy.sh   # and REV's tree in .device/clean/.base (bench/served.py's pulse-base)
set -euo pipefail
cd "$(dirname "$0")/.."
new=.device/clean.new
rm -rf "$new" && mkdir -p "$new"
git archive HEAD | tar x -C "$new"
git rev-parse HEAD > "$new/COMMIT"
if [[ -n "${BASE:-}" ]]; then
  mkdir -p "$new/.base"
  git archive "$BASE" | tar x -C "$new/.base"
  git rev-parse "$BASE" > "$new/.base/COMMIT"
fi
if [[ -d .device/devcache ]]; then
  cp -a .device/devcache "$new/.devcache"
elif [[ -e .device/clean/.devcache ]]; then
  cp -a .device/clean/.devcache "$new/"
fi
rm -rf .device/clean && mv "$new" .device/clean
echo ".device/clean: $(cat .device/clean/COMMIT) ($(du -sh .device/clean | cut -f1))${BASE:+, .base: $(cat .device/clean/.base/COMMIT)}"
