# Sourced by the bench/gpu_*.sh scripts on the device machine, from the tree's root: the staged site-packages and
# this tree on the path; Pulse's cache holding the tokenizer/info derived from the bundled GGUFs
# (.devcache/derived.tar.xz, bench/gpu_stage_extra.sh); the model's mtime pinned to the one they were derived under
# (a model's cache key is path + size + mtime). Sets `home` (the staged files) and `model` (Gemma 3 270M's GGUF).
home=${PULSE_DEVICE_HOME:-/root/pulse-device}
model=$home/model/gemma-3-270m-q4_k_m.gguf
export PYTHONPATH=$home/site:$PWD PYTHONUNBUFFERED=1 PULSE_CACHE_DIR=${PULSE_CACHE_DIR:-/root/pulse-cache}
touch -d @1700000000 "$model"
mkdir -p "$PULSE_CACHE_DIR"
tar xJf .devcache/derived.tar.xz -C "$PULSE_CACHE_DIR" 2>/dev/null ||
  echo "no .devcache/derived.tar.xz (bench/gpu_stage_extra.sh): Pulse derives the tokenizer at start" >&2
# llama_built: waits up to 6 min for bench/gpu_build_llama.sh's background build to end; true when it succeeded
llama_built() {
  for _ in $(seq 1 90); do [[ -f /root/lb/build.rc ]] && break; sleep 4; done
  [[ $(cat /root/lb/build.rc 2>/dev/null) == 0 ]]
}
