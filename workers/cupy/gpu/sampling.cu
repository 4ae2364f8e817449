// Greedy choice and sampling over the vocabulary, graph input preparation, and a profiling aid.
// (common.cuh is prepended by kernels.py.)

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

// Sampling, fused with the greedy choice: one pass over the logits for greedy and sampled rows alike.
// Per row, four int32 of parameters: key0, key1 (workers/cupy/rng.py's row key), 1/T as float bits (0: greedy)
// and whether to compute the chosen token's logprob. A sampled row takes argmax(logit / T + g), g the Gumbel
// noise of (key, vocabulary id): rng.py's function, written again here.
__device__ __forceinline__ unsigned mix32(unsigned x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}

__device__ __forceinline__ float gumbel_noise(unsigned id, unsigned k0, unsigned k1) {
  const unsigned h = mix32(mix32(id ^ k0) ^ k1);
  const float v = __uint2float_rn(h) * 2.3283064365386963e-10f + 1.1641532182693481e-10f;  // h/2^32 + 2^-33
  return -logf(-log1pf(-v));
}

// (max, sum of exp(x - max)) pairs: the log-sum-exp of a row in one pass
__device__ __forceinline__ void lse_merge(float& m, float& s, float om, float os) {
  const float nm = fmaxf(m, om);
  if (nm == -INFINITY) return;
  s = s * expf(m - nm) + os * expf(om - nm);
  m = nm;
}

// Stage 1: grid (chunks, rows), 256 threads, ARGMAX_CHUNK logits a block (as argmax_partial). params may be
// null (every row greedy, no logprobs); part_m / part_s only when params is not null.
extern "C" __global__ void sample_partial(const float* __restrict__ logits, int V, const int* __restrict__ params,
                                          float* __restrict__ part_v, int* __restrict__ part_i,
                                          float* __restrict__ part_m, float* __restrict__ part_s) {
  __shared__ float sv[8], sm[8], ss[8];
  __shared__ int si[8];
  const size_t row = blockIdx.y;
  const int base = blockIdx.x * ARGMAX_CHUNK;
  unsigned k0 = 0, k1 = 0;
  float inv_t = 0.f;
  int want = 0;
  if (params) {
    k0 = (unsigned)params[row * 4];
    k1 = (unsigned)params[row * 4 + 1];
    inv_t = __int_as_float(params[row * 4 + 2]);
    want = params[row * 4 + 3];
  }
  const float4* p = reinterpret_cast<const float4*>(logits + row * V + base);
  float4 v[4];
#pragma unroll
  for (int u = 0; u < 4; u++) {
    const int i4 = threadIdx.x + u * 256;
    v[u] = base + i4 * 4 < V ? p[i4] : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
  }
  float best = -INFINITY, m = -INFINITY, s = 0.f;
  int bi = 0x7fffffff;
#pragma unroll
  for (int u = 0; u < 4; u++) {
    const int i = base + (threadIdx.x + u * 256) * 4;
    const float x[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
    for (int e = 0; e < 4; e++) {
      if (i + e >= V) continue;
      const float score = inv_t > 0.f ? x[e] * inv_t + gumbel_noise((unsigned)(i + e), k0, k1) : x[e];
      better(best, bi, score, i + e);
      if (want) lse_merge(m, s, x[e], 1.f);
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    better(best, bi, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, bi, o));
    if (want) lse_merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
  }
  if ((threadIdx.x & 31) == 0) {
    sv[threadIdx.x >> 5] = best;
    si[threadIdx.x >> 5] = bi;
    sm[threadIdx.x >> 5] = m;
    ss[threadIdx.x >> 5] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < 8; w++) {
      better(best, bi, sv[w], si[w]);
      if (want) lse_merge(m, s, sm[w], ss[w]);
    }
    const size_t at = row * gridDim.x + blockIdx.x;
    part_v[at] = best;
    part_i[at] = bi;
    if (params) {
      part_m[at] = m;
      part_s[at] = s;
    }
  }
}

// Stage 2: one warp a row; the chosen id, and its logprob (logit - log-sum-exp, before temperature) when asked.
extern "C" __global__ void sample_final(const float* __restrict__ part_v, const int* __restrict__ part_i, int n,
                                        const int* __restrict__ params, const float* __restrict__ part_m,
                                        const float* __restrict__ part_s, const float* __restrict__ logits, int V,
                                        int* __restrict__ out, float* __restrict__ out_lp) {
  const size_t row = blockIdx.x;
  const int want = params ? params[row * 4 + 3] : 0;
  float best = -INFINITY, m = -INFINITY, s = 0.f;
  int bi = 0x7fffffff;
  for (int j = threadIdx.x; j < n; j += 32) {
    better(best, bi, part_v[row * n + j], part_i[row * n + j]);
    if (want) lse_merge(m, s, part_m[row * n + j], part_s[row * n + j]);
  }
  for (int o = 16; o > 0; o >>= 1) {
    better(best, bi, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, bi, o));
    if (want) lse_merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
  }
  if (threadIdx.x == 0) {
    out[row] = bi;
    if (want) out_lp[row] = logits[row * V + bi] - (m + logf(s));
  }
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
