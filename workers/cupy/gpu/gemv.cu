// Small-batch matrix products (M <= GEMV_MAX_M rows) with the step's elementwise work fused in front.
// (common.cuh is prepended by kernels.py.)
//
// Why: at batch 1-8 a decode step is a chain of ~165 dependent launches, each costing a few microseconds even
// replayed from a graph. cuBLAS cannot take a prologue, so every norm and the gelu were their own launch. Here
// each block recomputes the (cheap) prologue for the M rows into shared memory and then computes 16 output rows:
//   PLAIN     x = x_act                                         (attention output -> o)
//   ADD_NORM  r' = r + rms(delta) * w_post; x = rms(r') * w_norm (Gemma's sandwich norm, then q/k/v or gate/up)
//   GELU      x = gelu_tanh(gu[:, :K]) * gu[:, K:]               (then down)
//   EMBED     r' = emb[tok] * scale; x = rms(r') * w_norm        (layer 0's q/k/v)
// r' goes to resid_out, written by block 0 only; resid_in is a different buffer (ping-pong), so no block reads
// a residual another block is rewriting. Weights are (N, K) row-major, 16-byte loads; x and sums in fp32.
#define GEMV_MAX_M 8
#define GEMV_WARPS 8
#define GEMV_RPW 2  // output rows per warp
#define GEMV_MAXC 8  // 16-byte weight chunks per lane per row: K <= 2048
#define GEMV_PLAIN 0
#define GEMV_ADD_NORM 1
#define GEMV_GELU 2
#define GEMV_EMBED 3

__device__ __forceinline__ float gelu_tanh(float g) {
  return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

// One warp computes row m of the prologue into x (norm modes). All global loads of the row are issued in one
// pass into shared scratch (x, s0, s1, s2), so the prologue costs one memory latency, not three.
__device__ void gemv_norm_row(int mode, int m, int K, const float* __restrict__ src, const float* __restrict__ resid_in,
                              float* __restrict__ resid_out, const float* __restrict__ w_post,
                              const float* __restrict__ w_norm, const int* __restrict__ tok,
                              const act_t* __restrict__ emb, float emb_scale, float eps, float* x, float* s0,
                              float* s1, float* s2) {
  const int lane = threadIdx.x & 31;
  float ss = 0.f;
  if (mode == GEMV_EMBED) {
    const act_t* e = emb + (size_t)tok[m] * K;
    for (int k = lane; k < K; k += 32) {
      const float v = to_f(e[k]) * emb_scale;
      x[k] = v;
      s2[k] = w_norm[k];
      ss += v * v;
    }
  } else {
    const float* d = src + (size_t)m * K;
    const float* r = resid_in + (size_t)m * K;
    float sd = 0.f;
#pragma unroll 4
    for (int k = lane; k < K; k += 32) {
      const float dv = d[k];
      x[k] = dv;
      s0[k] = r[k];
      s1[k] = w_post[k];
      s2[k] = w_norm[k];
      sd += dv * dv;
    }
    const float inv1 = rsqrtf(warp_sum(sd) / K + eps);
    for (int k = lane; k < K; k += 32) {
      const float v = s0[k] + x[k] * inv1 * s1[k];
      x[k] = v;
      ss += v * v;
    }
  }
  const float inv = rsqrtf(warp_sum(ss) / K + eps);
  const bool write = resid_out != nullptr && blockIdx.x == 0;
  for (int k = lane; k < K; k += 32) {
    const float v = x[k];
    if (write) resid_out[(size_t)m * K + k] = v;
    x[k] = v * inv * s2[k];
  }
}

__device__ __forceinline__ void unpack8(const uint4& raw, float* f) {
  const act2_t* h2 = reinterpret_cast<const act2_t*>(&raw);
#pragma unroll
  for (int e = 0; e < 4; e++) {
    const float2 v = to_f2(h2[e]);
    f[2 * e] = v.x;
    f[2 * e + 1] = v.y;
  }
}

// out[m, n] = sum_k x[m, k] * W[n, k]. Grid: ceil(N / 16) blocks of 256 threads; dynamic shared M*K floats.
// out[m, n] = sum_k x[m, k] * W[n, k]. Grid: ceil(N / 16) blocks of 256 threads; K <= GEMV_MAXC * 256.
// Dynamic shared memory: M*K floats (PLAIN, GELU) or 4*M*K (norm modes: x and three scratch rows per row).
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
    gemv(int mode, int M, int K, int N, const act_t* __restrict__ W, const act_t* __restrict__ x_act,
         const float* __restrict__ src, const float* __restrict__ resid_in, float* __restrict__ resid_out,
         const float* __restrict__ w_post, const float* __restrict__ w_norm, const int* __restrict__ tok,
         const act_t* __restrict__ emb, float emb_scale, float eps, float* __restrict__ out) {
  extern __shared__ float xs[];  // [M][K], then scratch [M][3][K] in the norm modes
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n0 = (blockIdx.x * GEMV_WARPS + warp) * GEMV_RPW;
  const int chunks = K / 8;  // 16-byte chunks per weight row
  // the weights do not depend on the prologue: their loads go first and overlap it
  uint4 wv[GEMV_RPW][GEMV_MAXC];
#pragma unroll
  for (int r = 0; r < GEMV_RPW; r++)
#pragma unroll
    for (int j = 0; j < GEMV_MAXC; j++) {
      const int c = lane + 32 * j;
      wv[r][j] = (c < chunks && n0 + r < N) ? *reinterpret_cast<const uint4*>(W + (size_t)(n0 + r) * K + c * 8)
                                            : make_uint4(0, 0, 0, 0);
    }
  if (mode == GEMV_PLAIN) {
    for (int i = threadIdx.x; i < M * K; i += blockDim.x) xs[i] = to_f(x_act[i]);
  } else if (mode == GEMV_GELU) {
    for (int i = threadIdx.x; i < M * K; i += blockDim.x) {
      const int m = i / K, k = i % K;
      xs[i] = gelu_tanh(src[(size_t)m * 2 * K + k]) * src[(size_t)m * 2 * K + K + k];
    }
  } else if (warp < M) {
    float* scratch = xs + M * K + warp * 3 * K;
    gemv_norm_row(mode, warp, K, src, resid_in, resid_out, w_post, w_norm, tok, emb, emb_scale, eps, xs + warp * K,
                  scratch, scratch + K, scratch + 2 * K);
  }
  __syncthreads();

  float acc[GEMV_RPW][GEMV_MAX_M];
#pragma unroll
  for (int r = 0; r < GEMV_RPW; r++)
#pragma unroll
    for (int m = 0; m < GEMV_MAX_M; m++) acc[r][m] = 0.f;
#pragma unroll
  for (int j = 0; j < GEMV_MAXC; j++) {
    const int c = lane + 32 * j;
    if (c < chunks) {
      float wf[GEMV_RPW][8];
#pragma unroll
      for (int r = 0; r < GEMV_RPW; r++) unpack8(wv[r][j], wf[r]);
#pragma unroll
      for (int m = 0; m < GEMV_MAX_M; m++) {
        if (m < M) {
          const float4 a = *reinterpret_cast<const float4*>(xs + m * K + c * 8);
          const float4 b = *reinterpret_cast<const float4*>(xs + m * K + c * 8 + 4);
#pragma unroll
          for (int r = 0; r < GEMV_RPW; r++)
            acc[r][m] += a.x * wf[r][0] + a.y * wf[r][1] + a.z * wf[r][2] + a.w * wf[r][3] + b.x * wf[r][4] +
                         b.y * wf[r][5] + b.z * wf[r][6] + b.w * wf[r][7];
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < GEMV_RPW; r++)
#pragma unroll
    for (int m = 0; m < GEMV_MAX_M; m++) {
      if (m < M) {
        const float s = warp_sum(acc[r][m]);
        if (lane == 0 && n0 + r < N) out[(size_t)m * N + n0 + r] = s;
      }
    }
}
