# Instruction sets for llama.cpp's CPU backend, as CMake arguments; sourced by deploy/build_llama_server.sh
# and bench/gpu_build_llama.sh. Never GGML_NATIVE: -march=native on a VM whose CPU advertises features
# the VM does not enable (AMX) builds a binary that dies with SIGILL.

# The sets for this machine's architecture, preferred first; the last has nothing beyond the baseline.
isa_sets() {
  case "$(uname -m)" in
    x86_64|amd64) echo "x86-64-v3 x86-64" ;;
    aarch64|arm64) echo "armv8.2-a armv8-a" ;;
    *) echo "generic" ;;
  esac
}

# isa_args NAME: the CMake arguments of one set (every x86 switch explicit, so a reconfigured tree
# cannot keep one from an earlier set).
isa_args() {
  local no_wide="-DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF"
  no_wide+=" -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  case "$1" in
    # AVX, AVX2, FMA, F16C, BMI2 (x86-64-v3 less what ggml does not use): every x86-64 CPU since 2015
    x86-64-v3) echo "-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON" \
                    "-DGGML_F16C=ON -DGGML_BMI2=ON $no_wide" ;;
    x86-64) echo "-DGGML_NATIVE=OFF -DGGML_SSE42=OFF -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF" \
                 "-DGGML_F16C=OFF -DGGML_BMI2=OFF $no_wide" ;;
    # dot product and fp16 arithmetic: Neoverse N1 and later, Grace, GB10, Thor, Graviton 2+
    armv8.2-a) echo "-DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16" ;;
    armv8-a) echo "-DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=armv8-a" ;;
    generic) echo "-DGGML_NATIVE=OFF" ;;
    *) echo "unknown instruction set: $1 (known: x86-64-v3 x86-64 armv8.2-a armv8-a generic)" >&2; return 1 ;;
  esac
}

_cpu_flags() { grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null | cut -d: -f2; }

# isa_cpu_has NAME: whether this CPU advertises every feature NAME is built for.
isa_cpu_has() {
  local have need f
  have=" $(_cpu_flags) "
  case "$1" in
    x86-64-v3) need="sse4_2 avx avx2 fma f16c bmi2" ;;
    armv8.2-a) need="asimddp fphp asimdhp" ;;
    *) need="" ;;
  esac
  for f in $need; do [[ "$have" == *" $f "* ]] || return 1; done
}

# cpu_key: a short name for this CPU's feature set (the installed binary was checked on it).
cpu_key() { { uname -m; _cpu_flags; } | sha1sum | cut -c1-12; }
