// Pulse's fused kernels for one engine step (Gemma-3-shaped decoders), compiled by NVRTC through CuPy.
//
// Why these exist: a 270M-parameter decode step is launch-bound, not bandwidth-bound (weights ~0.2 GB against
// ~4 TB/s), so each kernel fuses what CuPy's generic ops would launch separately: RMSNorm with the residual add
// and the next norm, QK-norm with RoPE and the KV write, gelu(gate) * up, paged attention for any mix of
// prefill and decode tokens, and argmax over the vocabulary. Matrix products go to cuBLAS (cublas.py).
//
// Compile-time constants (defines passed by kernels.py): HEAD_DIM (256), GROUP (query heads per KV head, 4),
// ACT_BF16 (1: activations/weights/KV in bf16, else fp16). Residual stream and GEMM outputs stay fp32.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef HEAD_DIM
#define HEAD_DIM 256
#endif
#ifndef GROUP
#define GROUP 4
#endif

#if ACT_BF16
typedef __nv_bfloat16 act_t;
typedef __nv_bfloat162 act2_t;
__device__ __forceinline__ float to_f(act_t x) { return __bfloat162float(x); }
__device__ __forceinline__ act_t from_f(float x) { return __float2bfloat16(x); }
__device__ __forceinline__ float2 to_f2(act2_t x) { return __bfloat1622float2(x); }
#else
typedef __half act_t;
typedef __half2 act2_t;
__device__ __forceinline__ float to_f(act_t x) { return __half2float(x); }
__device__ __forceinline__ act_t from_f(float x) { return __float2half(x); }
__device__ __forceinline__ float2 to_f2(act2_t x) { return __half22float2(x); }
#endif

#ifndef INFINITY  // NVRTC has no math.h
#define INFINITY __int_as_float(0x7f800000)
#endif

// Programmatic dependent launch (pdl.py): wait until the previous kernel of the stream has completed and its
// writes are visible, then let the next one be scheduled. Both are no-ops for a normally launched kernel.
__device__ __forceinline__ void pdl_wait_then_trigger() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

#define LANE_DIMS (HEAD_DIM / 32)  // head dims per lane in attention: 8 = one 16-byte load

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// N partial sums a lane (N a power of two <= 32) summed over the warp in N - 1 + log2(32 / N) + 1 shuffles instead
// of 5 N: each halving step keeps half the values (the upper or lower half by the lane's bit b) and adds in the
// partner's (lane ^ b) copy of them, so the values spread over the lanes. Returns, in every lane, the whole warp's
// sum of value number lane / (32 / N).
template <int N>
__device__ __forceinline__ float warp_sum_many(float (&v)[N]) {
  const int lane = threadIdx.x & 31;
  int b = 16;
#pragma unroll
  for (int w = N / 2; w >= 1; w /= 2, b /= 2) {
    const bool upper = lane & b;
#pragma unroll
    for (int i = 0; i < w; i++) {
      const float send = upper ? v[i] : v[i + w], keep = upper ? v[i + w] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, b);
    }
  }
#pragma unroll
  for (; b > 0; b /= 2) v[0] += __shfl_xor_sync(0xffffffffu, v[0], b);
  return v[0];
}

// 16 bytes global -> shared without passing through registers (cp.async, sm_80 and later: many copies in flight a
// thread, so a block keeps far more bytes in flight than its registers could hold); a plain copy before sm_80.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#if __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
#else
  *reinterpret_cast<uint4*>(smem) = *reinterpret_cast<const uint4*>(gmem);
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// wait until at most N of this thread's committed groups are still in flight
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// Sum over the block; `sh` holds >= 32 floats. Leading barrier: `sh` may be reused back to back.
__device__ float block_sum(float v, float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  float s = 0.f;
  for (int i = 0; i < nw; i++) s += sh[i];
  return s;
}

// Load LANE_DIMS (8) consecutive activations as floats with one 16-byte load.
__device__ __forceinline__ void load8(const act_t* p, float* f) {
  uint4 raw = *reinterpret_cast<const uint4*>(p);
  const act2_t* h2 = reinterpret_cast<const act2_t*>(&raw);
#pragma unroll
  for (int e = 0; e < 4; e++) {
    float2 x = to_f2(h2[e]);
    f[2 * e] = x.x;
    f[2 * e + 1] = x.y;
  }
}

// Load one lane's LANE_DIMS consecutive activations as floats in one load: 16 bytes for head_dim 256 (load8),
// 8 for 128, 4 for 64 (Llama-family heads).
__device__ __forceinline__ void load_lane(const act_t* p, float* f) {
#if LANE_DIMS == 8
  load8(p, f);
#elif LANE_DIMS == 4
  uint2 raw = *reinterpret_cast<const uint2*>(p);
  const act2_t* h2 = reinterpret_cast<const act2_t*>(&raw);
#pragma unroll
  for (int e = 0; e < 2; e++) {
    float2 x = to_f2(h2[e]);
    f[2 * e] = x.x;
    f[2 * e + 1] = x.y;
  }
#elif LANE_DIMS == 2
  float2 x = to_f2(*reinterpret_cast<const act2_t*>(p));
  f[0] = x.x;
  f[1] = x.y;
#else
#error "head dims per lane: 2, 4 or 8 (HEAD_DIM 64, 128 or 256)"
#endif
}
