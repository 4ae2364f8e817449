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

// The norm modes' prologue over all M rows with the whole block (a row of 640 is only 2.5 elements a thread):
// one pass issues every global load into shared memory (x = delta or embedding, s0 = resid, s1 = w_post,
// s2 = w_norm, all flat [M*K]) and sums squares per row (K % 32 == 0: a warp's 32 elements share a row).
__device__ void gemv_norm_rows(int mode, int M, int K, const float* __restrict__ src,
                               const float* __restrict__ resid_in, float* __restrict__ resid_out,
                               const float* __restrict__ w_post, const float* __restrict__ w_norm,
                               const int* __restrict__ tok, const act_t* __restrict__ emb, float emb_scale, float eps,
                               float* x, float* s0, float* s1, float* s2) {
  __shared__ float sum1[GEMV_MAX_M], sum2[GEMV_MAX_M];
  const int lane = threadIdx.x & 31, n = M * K;
  if (threadIdx.x < GEMV_MAX_M) sum1[threadIdx.x] = sum2[threadIdx.x] = 0.f;
  __syncthreads();
  float* first = mode == GEMV_EMBED ? sum2 : sum1;
#pragma unroll 4
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int m = i / K, k = i - m * K;
    float v;
    if (mode == GEMV_EMBED) {
      v = to_f(emb[(size_t)tok[m] * K + k]) * emb_scale;
    } else {
      v = src[i];
      s0[i] = resid_in[i];
      s1[i] = w_post[k];
    }
    x[i] = v;
    s2[i] = w_norm[k];
    const float part = warp_sum(v * v);
    if (lane == 0) atomicAdd(first + m, part);
  }
  __syncthreads();
  if (mode != GEMV_EMBED) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const int m = i / K;
      const float v = s0[i] + x[i] * rsqrtf(sum1[m] / K + eps) * s1[i];
      x[i] = v;
      const float part = warp_sum(v * v);
      if (lane == 0) atomicAdd(sum2 + m, part);
    }
    __syncthreads();
  }
  const bool write = resid_out != nullptr && blockIdx.x == 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int m = i / K;
    const float v = x[i];
    if (write) resid_out[i] = v;
    x[i] = v * rsqrtf(sum2[m] / K + eps) * s2[i];
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
// Dynamic shared memory: M*K floats (PLAIN, GELU) or 4*M*K (norm modes: x and three scratch arrays).
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
    gemv(int mode, int M, int K, int N, const act_t* __restrict__ W, const act_t* __restrict__ x_act,
         const float* __restrict__ src, const float* __restrict__ resid_in, float* __restrict__ resid_out,
         const float* __restrict__ w_post, const float* __restrict__ w_norm, const int* __restrict__ tok,
         const act_t* __restrict__ emb, float emb_scale, float eps, float* __restrict__ out,
         float* __restrict__ zero_out, int zero_n) {
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
  pdl_wait_then_trigger();  // everything below reads what earlier kernels wrote
  // zero_out: an accumulator a later launch adds into (mlp_fused's output), cleared here for free
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < zero_n; i += gridDim.x * blockDim.x) zero_out[i] = 0.f;
  if (mode == GEMV_PLAIN) {
    for (int i = threadIdx.x; i < M * K; i += blockDim.x) xs[i] = to_f(x_act[i]);
  } else if (mode == GEMV_GELU) {
    for (int i = threadIdx.x; i < M * K; i += blockDim.x) {
      const int m = i / K, k = i % K;
      xs[i] = gelu_tanh(src[(size_t)m * 2 * K + k]) * src[(size_t)m * 2 * K + K + k];
    }
  } else {
    const int n = M * K;
    gemv_norm_rows(mode, M, K, src, resid_in, resid_out, w_post, w_norm, tok, emb, emb_scale, eps, xs, xs + n,
                   xs + 2 * n, xs + 3 * n);
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

// The whole MLP of a small decode batch in one launch: sandwich norm (ADD_NORM prologue), gate/up for this
// block's MLP_F features, gelu(gate) * up, and their share of the down product, added into out with fp32
// atomics (out must be zero: the o-proj gemv before it clears it). Saves two launches a layer; the sums'
// order varies run to run in the last fp32 bits. Grid: F / MLP_F blocks of 256 threads; H <= 1024;
// dynamic shared memory 4*M*H floats.
#define MLP_F 16
#define MLP_MAXC 4  // 16-byte chunks per lane of a gate/up row: H <= 1024
#define MLP_MAXD 8  // down-weight 16-byte items per thread: 2 per hidden row, H <= 1024
extern "C" __global__ void __launch_bounds__(256)
    mlp_fused(int M, int H, int F, const act_t* __restrict__ gate_up, const act_t* __restrict__ down,
              const float* __restrict__ o, const float* __restrict__ resid_in, float* __restrict__ resid_out,
              const float* __restrict__ w_post, const float* __restrict__ w_norm, float eps,
              float* __restrict__ out) {
  extern __shared__ float xs[];
  __shared__ float dots[GEMV_MAX_M][2 * MLP_F];
  __shared__ float a[GEMV_MAX_M][MLP_F];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, f0 = blockIdx.x * MLP_F;
  const int chunks = H / 8;
  // every weight load first: 4 gate/up rows per warp, and this thread's down items (row n, half h)
  uint4 wv[4][MLP_MAXC];
#pragma unroll
  for (int r = 0; r < 4; r++) {
    const int j = warp * 4 + r;  // 0..15 gate rows, 16..31 up rows of this block's features
    const size_t row = j < MLP_F ? f0 + j : F + f0 + (j - MLP_F);
#pragma unroll
    for (int i = 0; i < MLP_MAXC; i++) {
      const int c = lane + 32 * i;
      wv[r][i] = c < chunks ? *reinterpret_cast<const uint4*>(gate_up + row * H + c * 8) : make_uint4(0, 0, 0, 0);
    }
  }
  uint4 dv[MLP_MAXD];
#pragma unroll
  for (int i = 0; i < MLP_MAXD; i++) {
    const int item = threadIdx.x + 256 * i;  // row item / 2, half item % 2
    dv[i] = item < 2 * H ? *reinterpret_cast<const uint4*>(down + (size_t)(item >> 1) * F + f0 + (item & 1) * 8)
                         : make_uint4(0, 0, 0, 0);
  }
  pdl_wait_then_trigger();  // the weights are in flight; now the inputs earlier kernels wrote
  const int n = M * H;
  gemv_norm_rows(GEMV_ADD_NORM, M, H, o, resid_in, resid_out, w_post, w_norm, nullptr, nullptr, 1.f, eps, xs,
                 xs + n, xs + 2 * n, xs + 3 * n);
  __syncthreads();
  // gate/up dot products
  float acc[4][GEMV_MAX_M];
#pragma unroll
  for (int r = 0; r < 4; r++)
#pragma unroll
    for (int m = 0; m < GEMV_MAX_M; m++) acc[r][m] = 0.f;
#pragma unroll
  for (int i = 0; i < MLP_MAXC; i++) {
    const int c = lane + 32 * i;
    if (c < chunks) {
      float wf[4][8];
#pragma unroll
      for (int r = 0; r < 4; r++) unpack8(wv[r][i], wf[r]);
#pragma unroll
      for (int m = 0; m < GEMV_MAX_M; m++) {
        if (m < M) {
          const float4 p = *reinterpret_cast<const float4*>(xs + m * H + c * 8);
          const float4 q = *reinterpret_cast<const float4*>(xs + m * H + c * 8 + 4);
#pragma unroll
          for (int r = 0; r < 4; r++)
            acc[r][m] += p.x * wf[r][0] + p.y * wf[r][1] + p.z * wf[r][2] + p.w * wf[r][3] + q.x * wf[r][4] +
                         q.y * wf[r][5] + q.z * wf[r][6] + q.w * wf[r][7];
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 4; r++)
#pragma unroll
    for (int m = 0; m < GEMV_MAX_M; m++)
      if (m < M) {
        const float s = warp_sum(acc[r][m]);
        if (lane == 0) dots[m][warp * 4 + r] = s;
      }
  __syncthreads();
  if (threadIdx.x < M * MLP_F) {
    const int m = threadIdx.x / MLP_F, j = threadIdx.x % MLP_F;
    a[m][j] = gelu_tanh(dots[m][j]) * dots[m][MLP_F + j];
  }
  __syncthreads();
  // this block's share of down: row n gets sum over its 16 features, two 8-feature halves in adjacent lanes
#pragma unroll
  for (int i = 0; i < MLP_MAXD; i++) {
    const int item = threadIdx.x + 256 * i;
    if (256 * i >= 2 * H) break;  // uniform: whole iterations past the rows
    float wf[8];
    unpack8(dv[i], wf);
    const int h = item & 1;
#pragma unroll
    for (int m = 0; m < GEMV_MAX_M; m++) {
      if (m < M) {
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < 8; e++) s += wf[e] * a[m][h * 8 + e];
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        if (h == 0 && item < 2 * H) atomicAdd(out + (size_t)m * H + (item >> 1), s);
      }
    }
  }
}
