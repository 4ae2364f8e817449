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

#define LANE_DIMS (HEAD_DIM / 32)  // head dims per lane in attention: 8 = one 16-byte load

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
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

// resid = emb[tok] * scale (fp32); out = rmsnorm(resid) * w. One block per token.
extern "C" __global__ void embed_norm(const int* __restrict__ tok, const act_t* __restrict__ emb, float scale,
                                      const float* __restrict__ w, float eps, int H, float* __restrict__ resid,
                                      act_t* __restrict__ out) {
  __shared__ float sh[32];
  const size_t t = blockIdx.x;
  const act_t* e = emb + (size_t)tok[t] * H;
  float* r = resid + t * H;
  float ss = 0.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    float v = to_f(e[i]) * scale;
    r[i] = v;
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss, sh) / H + eps);
  for (int i = threadIdx.x; i < H; i += blockDim.x) out[t * H + i] = from_f(r[i] * inv * w[i]);
}

// Gemma's sandwich norm at a layer boundary, fused:
//   resid[src] += rmsnorm(delta[src]) * w_post;  out[blockIdx] = rmsnorm(resid[src]) * w_next
// rows == nullptr: src = blockIdx.x and resid is updated in place. rows != nullptr (the final norm before
// the output head): src = rows[blockIdx.x], only the selected rows are computed and resid is left alone.
// Dynamic shared memory: H floats.
extern "C" __global__ void add_norm(float* __restrict__ resid, const float* __restrict__ delta,
                                    const float* __restrict__ w_post, const float* __restrict__ w_next,
                                    const long long* __restrict__ rows, float eps, int H,
                                    act_t* __restrict__ out) {
  extern __shared__ float buf[];
  __shared__ float sh[32];
  const size_t src = rows ? (size_t)rows[blockIdx.x] : (size_t)blockIdx.x;
  const float* d = delta + src * H;
  float* r = resid + src * H;
  float ss = 0.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    float v = d[i];
    ss += v * v;
  }
  const float inv1 = rsqrtf(block_sum(ss, sh) / H + eps);
  float ss2 = 0.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    float v = r[i] + d[i] * inv1 * w_post[i];
    buf[i] = v;
    ss2 += v * v;
  }
  const float inv2 = rsqrtf(block_sum(ss2, sh) / H + eps);
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    if (!rows) r[i] = buf[i];
    out[(size_t)blockIdx.x * H + i] = from_f(buf[i] * inv2 * w_next[i]);
  }
}

// After the fused q/k/v product: RMSNorm per head on q and k (QK-norm), NeoX RoPE on both, q written for
// attention, k and v written into the paged cache at the token's slot. One block of HEAD_DIM threads per token.
// Angles in float64 like the NumPy path (positions up to 32k times 1e6-base frequencies).
extern "C" __global__ void qkv_post(const float* __restrict__ qkv, const float* __restrict__ qn_w,
                                    const float* __restrict__ kn_w, const int* __restrict__ pos,
                                    const long long* __restrict__ slots, float theta, float pos_scale, float eps,
                                    int NH, int NKV, act_t* __restrict__ q_out, act_t* __restrict__ kc,
                                    act_t* __restrict__ vc) {
  __shared__ float sh[32];
  __shared__ float buf[HEAD_DIM];
  const size_t t = blockIdx.x;
  const int d = threadIdx.x, half_d = HEAD_DIM / 2;
  const float* row = qkv + t * (size_t)(NH + 2 * NKV) * HEAD_DIM;
  const long long slot = slots[t];
  const int i = d % half_d;
  const double inv_freq = pow((double)theta, -2.0 * i / HEAD_DIM);
  const double ang = ((double)pos[t] / pos_scale) * inv_freq;
  const float c = (float)cos(ang), s = (float)sin(ang);
  for (int h = 0; h < NH + NKV; h++) {
    const float x = row[h * HEAD_DIM + d];
    const float inv = rsqrtf(block_sum(x * x, sh) / HEAD_DIM + eps);
    const float y = x * inv * (h < NH ? qn_w[d] : kn_w[d]);
    buf[d] = y;
    __syncthreads();
    const float partner = buf[d < half_d ? d + half_d : d - half_d];
    const float o = d < half_d ? y * c - partner * s : y * c + partner * s;
    __syncthreads();
    if (h < NH)
      q_out[(t * NH + h) * HEAD_DIM + d] = from_f(o);
    else
      kc[((size_t)slot * NKV + (h - NH)) * HEAD_DIM + d] = from_f(o);
  }
  for (int h = 0; h < NKV; h++)
    vc[((size_t)slot * NKV + h) * HEAD_DIM + d] = from_f(row[(NH + NKV + h) * HEAD_DIM + d]);
}

#define ATT_WARPS 8
#define ATT_CHUNK 256
#define ATT_UNROLL 4

// Paged attention for a flat step of T query tokens (prefill chunks and decode tokens mixed): token t of
// block-table row tok_row[t] at position pos[t] attends to its sequence's keys [start, pos[t]], start =
// pos - window + 1 on sliding-window layers. The step's own K/V are already in the cache (qkv_post ran), so
// causality inside a prefill chunk is by position alone. Grid (T, NKV); 256 threads; the GROUP query heads
// sharing a KV head read each key once. Keys go in chunks of ATT_CHUNK: scores to shared memory, an online
// softmax across chunks, then P.V with each warp owning a strided subset of keys and each lane 8 dims.
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
    attention(const act_t* __restrict__ q, const act_t* __restrict__ kc, const act_t* __restrict__ vc,
              const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ tok_row,
              const int* __restrict__ pos, int block_size, int window, float scale, int NKV,
              act_t* __restrict__ out) {
  __shared__ float sc[GROUP][ATT_CHUNK];
  __shared__ float red[ATT_WARPS][GROUP][HEAD_DIM];
  __shared__ float chunk_m[GROUP], chunk_s[GROUP];
  const int t = blockIdx.x, kvh = blockIdx.y, NH = NKV * GROUP;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int p = pos[t];
  const int start = window > 0 ? max(0, p - window + 1) : 0, end = p + 1;
  const int* bt = block_tables + (size_t)tok_row[t] * max_blocks;
  // chunk_m holds the running max after each chunk; the softmax warps read it back (a register array
  // indexed by the warp number would go to local memory)
  if (threadIdx.x < GROUP) chunk_m[threadIdx.x] = -INFINITY;

  float qr[GROUP][LANE_DIMS], acc[GROUP][LANE_DIMS], m[GROUP], l[GROUP];
#pragma unroll
  for (int g = 0; g < GROUP; g++) {
    load8(q + ((size_t)t * NH + kvh * GROUP + g) * HEAD_DIM + lane * LANE_DIMS, qr[g]);
#pragma unroll
    for (int e = 0; e < LANE_DIMS; e++) {
      qr[g][e] *= scale;
      acc[g][e] = 0.f;
    }
    m[g] = -INFINITY;
    l[g] = 0.f;
  }

  for (int c0 = start; c0 < end; c0 += ATT_CHUNK) {
    const int n = min(ATT_CHUNK, end - c0);
    // scores: ATT_UNROLL keys per warp per iteration, all loads issued before the first use (each key's
    // block-table lookup and 16-byte load would otherwise be one full memory latency apiece)
    for (int j0 = warp; j0 < n; j0 += ATT_WARPS * ATT_UNROLL) {
      float kf[ATT_UNROLL][LANE_DIMS];
#pragma unroll
      for (int u = 0; u < ATT_UNROLL; u++) {
        const int j = j0 + u * ATT_WARPS;
        if (j < n) {
          const int kp = c0 + j;
          const size_t slot = (size_t)bt[kp / block_size] * block_size + kp % block_size;
          load8(kc + (slot * NKV + kvh) * HEAD_DIM + lane * LANE_DIMS, kf[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < ATT_UNROLL; u++) {
        const int j = j0 + u * ATT_WARPS;
        if (j < n) {  // uniform across the warp: the shuffles below are safe
#pragma unroll
          for (int g = 0; g < GROUP; g++) {
            float s = 0.f;
#pragma unroll
            for (int e = 0; e < LANE_DIMS; e++) s += qr[g][e] * kf[u][e];
            s = warp_sum(s);
            if (lane == 0) sc[g][j] = s;
          }
        }
      }
    }
    __syncthreads();
    // chunk softmax: warp g owns head g; probabilities replace the scores in place
    if (warp < GROUP) {
      float cm = -INFINITY;
      for (int j = lane; j < n; j += 32) cm = fmaxf(cm, sc[warp][j]);
      cm = fmaxf(warp_max(cm), chunk_m[warp]);
      float cs = 0.f;
      for (int j = lane; j < n; j += 32) {
        const float e = __expf(sc[warp][j] - cm);
        sc[warp][j] = e;
        cs += e;
      }
      cs = warp_sum(cs);
      if (lane == 0) {
        chunk_m[warp] = cm;
        chunk_s[warp] = cs;
      }
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
      const float alpha = __expf(m[g] - chunk_m[g]);  // 0 on the first chunk (m = -inf)
      l[g] = l[g] * alpha + chunk_s[g];
      m[g] = chunk_m[g];
#pragma unroll
      for (int e = 0; e < LANE_DIMS; e++) acc[g][e] *= alpha;
    }
    // P.V, loads batched the same way
    for (int j0 = warp; j0 < n; j0 += ATT_WARPS * ATT_UNROLL) {
      float vf[ATT_UNROLL][LANE_DIMS];
#pragma unroll
      for (int u = 0; u < ATT_UNROLL; u++) {
        const int j = j0 + u * ATT_WARPS;
        if (j < n) {
          const int kp = c0 + j;
          const size_t slot = (size_t)bt[kp / block_size] * block_size + kp % block_size;
          load8(vc + (slot * NKV + kvh) * HEAD_DIM + lane * LANE_DIMS, vf[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < ATT_UNROLL; u++) {
        const int j = j0 + u * ATT_WARPS;
        if (j < n) {
#pragma unroll
          for (int g = 0; g < GROUP; g++) {
            const float pg = sc[g][j];
#pragma unroll
            for (int e = 0; e < LANE_DIMS; e++) acc[g][e] += pg * vf[u][e];
          }
        }
      }
    }
    __syncthreads();  // sc is overwritten by the next chunk
  }
  // combine the warps' partial sums
#pragma unroll
  for (int g = 0; g < GROUP; g++)
#pragma unroll
    for (int e = 0; e < LANE_DIMS; e++) red[warp][g][lane * LANE_DIMS + e] = acc[g][e];
  __syncthreads();
  for (int o = threadIdx.x; o < GROUP * HEAD_DIM; o += blockDim.x) {
    const int g = o / HEAD_DIM, d = o % HEAD_DIM;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++) s += red[w][g][d];
    out[((size_t)t * NH + kvh * GROUP + g) * HEAD_DIM + d] = from_f(s / l[g]);
  }
}

// out[t, f] = gelu_tanh(gu[t, f]) * gu[t, F + f]   (gate and up come from one product)
extern "C" __global__ void gelu_mul(const float* __restrict__ gu, int F, long long n, act_t* __restrict__ out) {
  for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < n;
       idx += (long long)gridDim.x * blockDim.x) {
    const long long t = idx / F, f = idx % F;
    const float g = gu[t * 2 * F + f], u = gu[t * 2 * F + F + f];
    const float y = 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    out[idx] = from_f(y * u);
  }
}

// Greedy choice per logits row: the first index of the maximum (NumPy's argmax tie rule). 1024 threads a row.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int V, int* __restrict__ out) {
  __shared__ float sv[32];
  __shared__ int si[32];
  const float* row = logits + (size_t)blockIdx.x * V;
  float best = -INFINITY;
  int bi = 0x7fffffff;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const float v = row[i];
    if (v > best) {  // strided ascending scan: the first max of this thread's share wins
      best = v;
      bi = i;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ov > best || (ov == best && oi < bi)) {
      best = ov;
      bi = oi;
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) {
    sv[warp] = best;
    si[warp] = bi;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < nw; w++)
      if (sv[w] > best || (sv[w] == best && si[w] < bi)) {
        best = sv[w];
        bi = si[w];
      }
    out[blockIdx.x] = bi;
  }
}

// Greedy choice, stage 1: many blocks per row (one block scanning 262k logits is ~256 dependent loads per
// thread). Grid (chunks, rows), 256 threads, ARGMAX_CHUNK logits per block as four 16-byte loads a thread.
#define ARGMAX_CHUNK 4096
__device__ __forceinline__ void better(float& best, int& bi, float v, int i) {
  if (v > best || (v == best && i < bi)) {
    best = v;
    bi = i;
  }
}

extern "C" __global__ void argmax_partial(const float* __restrict__ logits, int V, float* __restrict__ part_v,
                                          int* __restrict__ part_i) {
  __shared__ float sv[8];
  __shared__ int si[8];
  const size_t row = blockIdx.y;
  const int base = blockIdx.x * ARGMAX_CHUNK;
  const float4* p = reinterpret_cast<const float4*>(logits + row * V + base);
  float4 v[4];
#pragma unroll
  for (int u = 0; u < 4; u++) {
    const int i4 = threadIdx.x + u * 256;
    v[u] = base + i4 * 4 < V ? p[i4] : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
  }
  float best = -INFINITY;
  int bi = 0x7fffffff;
#pragma unroll
  for (int u = 0; u < 4; u++) {
    const int i = base + (threadIdx.x + u * 256) * 4;
    if (i < V) {
      better(best, bi, v[u].x, i);
      better(best, bi, v[u].y, i + 1);
      better(best, bi, v[u].z, i + 2);
      better(best, bi, v[u].w, i + 3);
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    better(best, bi, ov, oi);
  }
  if ((threadIdx.x & 31) == 0) {
    sv[threadIdx.x >> 5] = best;
    si[threadIdx.x >> 5] = bi;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < 8; w++) better(best, bi, sv[w], si[w]);
    part_v[row * gridDim.x + blockIdx.x] = best;
    part_i[row * gridDim.x + blockIdx.x] = bi;
  }
}

// Stage 2: one warp per row over the stage-1 winners.
extern "C" __global__ void argmax_final(const float* __restrict__ part_v, const int* __restrict__ part_i, int n,
                                        int* __restrict__ out) {
  const size_t row = blockIdx.x;
  float best = -INFINITY;
  int bi = 0x7fffffff;
  for (int j = threadIdx.x; j < n; j += 32) better(best, bi, part_v[row * n + j], part_i[row * n + j]);
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    better(best, bi, ov, oi);
  }
  if (threadIdx.x == 0) out[row] = bi;
}

// Profiling aid: hold the stream for `ns` nanoseconds so the launches queued behind it run back to back and
// events between them time the kernels, not Python's launch gaps.
extern "C" __global__ void spin(long long ns) {
  const long long t0 = clock64();
  (void)t0;
  unsigned long long start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  unsigned long long now = start;
  while ((long long)(now - start) < ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
}

// First node of a decode graph: positions and KV slots from the packed per-step input (positions, then the
// block tables). A negative position marks a padding row (the graph is captured for more rows than are live):
// it computes at position 0 and writes its K/V to the scratch slot, so no live block is touched.
extern "C" __global__ void prepare(const int* __restrict__ pos_in, const int* __restrict__ block_tables,
                                   int max_blocks, int block_size, long long scratch_slot, int n,
                                   int* __restrict__ pos, long long* __restrict__ slots) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= n) return;
  const int p = pos_in[b];
  if (p < 0) {
    pos[b] = 0;
    slots[b] = scratch_slot;
    return;
  }
  pos[b] = p;
  slots[b] = (long long)block_tables[(size_t)b * max_blocks + p / block_size] * block_size + p % block_size;
}

// Device-resident decode loop (benchmarks): the chosen tokens become the next step's input and the live
// rows' positions advance, so consecutive graph replays need no host input.
extern "C" __global__ void advance(const int* __restrict__ chosen, int n_live, int* __restrict__ tok,
                                   int* __restrict__ pos_in) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= n_live) return;
  tok[b] = chosen[b];
  pos_in[b] += 1;
}
