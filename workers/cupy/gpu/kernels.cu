// Pulse's fused kernels for one engine step: norms, QK-norm + RoPE + KV write, paged attention, gelu * up.
// (common.cuh is prepended by kernels.py; see its header for the why and the compile-time constants.)

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

// QK-norm then NeoX RoPE for all NR heads of one token at once, one element per thread (blockDim ==
// HEAD_DIM): every load issued up front, one block reduction for all heads' sums, one exchange for the rotation
// partners. x[h] is head h's raw element d; w[h] its norm weight; cos/sin come from the model's tables (float64
// angles rounded once, as the NumPy path does). Returns the rotated values in x. All threads must call.
template <int NR>
__device__ void norm_rope_heads(float* x, const float* w, float c, float s, float eps, float (*buf)[HEAD_DIM],
                                float (*sh)[32]) {
  const int d = threadIdx.x, lane = d & 31, warp = d >> 5, nw = HEAD_DIM / 32, half_d = HEAD_DIM / 2;
#pragma unroll
  for (int h = 0; h < NR; h++) {
    const float v = warp_sum(x[h] * x[h]);
    if (lane == 0) sh[h][warp] = v;
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < NR; h++) {
    float ss = 0.f;
    for (int i = 0; i < nw; i++) ss += sh[h][i];
    x[h] = x[h] * rsqrtf(ss / HEAD_DIM + eps) * w[h];
    buf[h][d] = x[h];
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < NR; h++) {
    const float partner = buf[h][d < half_d ? d + half_d : d - half_d];
    x[h] = d < half_d ? x[h] * c - partner * s : x[h] * c + partner * s;
  }
}

// After the fused q/k/v product: QK-norm and RoPE on q and k, q written for attention, k and v written into
// the paged cache at the token's slot. One block of HEAD_DIM threads per token. (Decode steps fold this into
// the attention kernel instead; prefill chunks need every token's K/V written before any attention reads.)
// Written for one KV head (Gemma 3): GROUP query heads + 1 key head.
extern "C" __global__ void qkv_post(const float* __restrict__ qkv, const float* __restrict__ qn_w,
                                    const float* __restrict__ kn_w, const int* __restrict__ pos,
                                    const long long* __restrict__ slots, const float* __restrict__ rcos,
                                    const float* __restrict__ rsin, float eps, int NH, int NKV,
                                    act_t* __restrict__ q_out, act_t* __restrict__ kc, act_t* __restrict__ vc) {
  __shared__ float sh[GROUP + 1][32];
  __shared__ float buf[GROUP + 1][HEAD_DIM];
  const size_t t = blockIdx.x;
  const int d = threadIdx.x, half_d = HEAD_DIM / 2;
  const float* row = qkv + t * (size_t)(GROUP + 2) * HEAD_DIM;
  const long long slot = slots[t];
  const size_t p = pos[t];
  float x[GROUP + 1], w[GROUP + 1];
#pragma unroll
  for (int h = 0; h <= GROUP; h++) {
    x[h] = row[h * HEAD_DIM + d];
    w[h] = h < GROUP ? qn_w[d] : kn_w[d];
  }
  const float v = row[(GROUP + 1) * HEAD_DIM + d];
  const float c = rcos[p * half_d + d % half_d], s = rsin[p * half_d + d % half_d];
  norm_rope_heads<GROUP + 1>(x, w, c, s, eps, buf, sh);
#pragma unroll
  for (int h = 0; h < GROUP; h++) q_out[(t * GROUP + h) * HEAD_DIM + d] = from_f(x[h]);
  kc[(size_t)slot * HEAD_DIM + d] = from_f(x[GROUP]);
  vc[(size_t)slot * HEAD_DIM + d] = from_f(v);
}

#define ATT_WARPS 8
#define ATT_CHUNK 256
#ifndef ATT_UNROLL  // keys a warp takes at once (kernels.py passes attention_settings(): PULSE_GPU_ATT_UNROLL, 2)
#define ATT_UNROLL 4
#endif
#define ATT_SBT 64  // >= ATT_CHUNK / 8 + 2: a chunk's entries always fit (block_size >= 8)
#ifndef ATT_XRED  // the scores' warp sums: 1 = one many-value reduction per batch of keys (warp_sum_many), 0 = one each
#define ATT_XRED 0
#endif
#define ATT_NV (GROUP * ATT_UNROLL)  // scores a warp computes per batch of keys
#if ATT_XRED && (ATT_NV & (ATT_NV - 1)) == 0 && ATT_NV <= 32
#define ATT_XRED_ON 1
#else
#define ATT_XRED_ON 0  // GROUP x ATT_UNROLL not a power of two <= 32 (e.g. Llama's GROUP 3): one sum per score
#endif
#ifndef ATT_MIN_BLOCKS  // blocks per SM the compiler must leave registers for (kernels.py: 2; Llama's module: 1)
#define ATT_MIN_BLOCKS 1
#endif
#ifndef ATT_ASYNC  // 1: keys and values reach shared memory by cp.async in tiles, ATT_STAGES buffers (kernels.py: 1)
#define ATT_ASYNC 0
#endif
#define ATT_TILE (ATT_WARPS * ATT_UNROLL)  // keys a tile (ATT_ASYNC): ATT_UNROLL a warp
#ifndef ATT_STAGES  // tile buffers (ATT_ASYNC): ATT_STAGES - 1 tiles in flight while one is used (PULSE_GPU_ATT_STAGES)
#define ATT_STAGES 2
#endif
// the warps' partial sums at the end, and (ATT_ASYNC) the tile buffers before: one shared pool
#define ATT_RED_BYTES (ATT_WARPS * GROUP * HEAD_DIM * 4)
#define ATT_TILES_BYTES (ATT_ASYNC ? ATT_STAGES * ATT_TILE * HEAD_DIM * (int)sizeof(act_t) : 0)
#define ATT_POOL_BYTES (ATT_RED_BYTES > ATT_TILES_BYTES ? ATT_RED_BYTES : ATT_TILES_BYTES)

// ATT_ASYNC: start copying tile s of a chunk's keys (s < n_tiles) or values (s - n_tiles) into tile buffer
// s % ATT_STAGES, and commit the group (an empty one past the last tile, so that every thread's groups count alike)
__device__ __forceinline__ void att_copy_tile(int s, int n_tiles, int n, int c0, int b0, int block_size, int NKV,
                                              int kvh, const act_t* kc, const act_t* vc, const int* sbt, act_t* tiles) {
  if (s < 2 * n_tiles) {
    const bool is_v = s >= n_tiles;
    const int base = (is_v ? s - n_tiles : s) * ATT_TILE;
    const act_t* src = is_v ? vc : kc;
    act_t* dst = tiles + (s % ATT_STAGES) * ATT_TILE * HEAD_DIM;
    constexpr int PIECES = HEAD_DIM * (int)sizeof(act_t) / 16;  // 16-byte copies a key
    for (int i = threadIdx.x; i < ATT_TILE * PIECES; i += ATT_WARPS * 32) {
      const int jj = i / PIECES, piece = i % PIECES, kp = c0 + base + jj;
      if (base + jj < n) {
        const size_t slot = (size_t)sbt[kp / block_size - b0] * block_size + kp % block_size;
        cp_async16(dst + jj * HEAD_DIM + piece * 8, src + (slot * NKV + kvh) * HEAD_DIM + piece * 8);
      }
    }
  }
  cp_async_commit();
}

// The scores of a warp's ATT_UNROLL keys kf[u] (key j0 + u * ATT_WARPS of the chunk; keys >= n score nothing)
// against the GROUP queries, into sc.
__device__ __forceinline__ void att_scores(const float (&qr)[GROUP][LANE_DIMS],
                                           const float (&kf)[ATT_UNROLL][LANE_DIMS], int j0, int n,
                                           float (*sc)[ATT_CHUNK]) {
  const int lane = threadIdx.x & 31;
#if ATT_XRED_ON
  float sv[ATT_NV];  // score (key u, head g) at u * GROUP + g; keys past the chunk score 0 and are not stored
#pragma unroll
  for (int u = 0; u < ATT_UNROLL; u++)
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
      float s = 0.f;
      if (j0 + u * ATT_WARPS < n)
#pragma unroll
        for (int e = 0; e < LANE_DIMS; e++) s += qr[g][e] * kf[u][e];
      sv[u * GROUP + g] = s;
    }
  const float s = warp_sum_many<ATT_NV>(sv);
  const int idx = lane / (32 / ATT_NV), j = j0 + idx / GROUP * ATT_WARPS;
  if (lane % (32 / ATT_NV) == 0 && j < n) sc[idx % GROUP][j] = s;
#else
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
#endif
}

// acc += the probabilities in sc of a warp's ATT_UNROLL keys times their values vf[u] (as att_scores' keys)
__device__ __forceinline__ void att_pv(float (&acc)[GROUP][LANE_DIMS], const float (&vf)[ATT_UNROLL][LANE_DIMS],
                                       int j0, int n, const float (*sc)[ATT_CHUNK]) {
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

// A chunk's softmax once every score is in sc (warp g owns head g; probabilities replace the scores in place),
// then the online rescale of every thread's running max m, sum l and accumulator acc. Barrier inside.
__device__ __forceinline__ void att_softmax(float (*sc)[ATT_CHUNK], int n, float* chunk_m, float* chunk_s,
                                            float (&m)[GROUP], float (&l)[GROUP], float (&acc)[GROUP][LANE_DIMS]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
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
}

// Paged attention for a flat step of T query tokens (prefill chunks and decode tokens mixed): token t of
// block-table row tok_row[t] at position pos[t] attends to its sequence's keys [start, pos[t]], start =
// pos - window + 1 on sliding-window layers. The step's own K/V are already in the cache (qkv_post ran), so
// causality inside a prefill chunk is by position alone. Grid (T, NKV); 256 threads; the GROUP query heads
// sharing a KV head read each key once. Keys go in chunks of ATT_CHUNK: scores to shared memory, an online
// softmax across chunks, then P.V with each warp owning a strided subset of keys and each lane 8 dims.
// n_split > 1 (decode steps, grid z = split): the keys are divided among n_split blocks (flash-decoding), each
// writes its unnormalised partial (acc, max, sum) to `part`, and the last block to finish a token (an atomic
// count in `counter`, reset by that block) merges them in split order: short chains, more blocks in flight.
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32, ATT_MIN_BLOCKS)
    attention(const act_t* __restrict__ q, act_t* kc, act_t* vc,  // written too on fused decode steps
              const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ tok_row,
              const int* __restrict__ pos, int block_size, int window, float scale, int NKV,
              act_t* __restrict__ out, const float* __restrict__ qkv, const float* __restrict__ qn_w,
              const float* __restrict__ kn_w, const long long* __restrict__ slots, const float* __restrict__ rcos,
              const float* __restrict__ rsin, float eps, int n_split, float* __restrict__ part,
              unsigned int* __restrict__ counter) {
  __shared__ float sc[GROUP][ATT_CHUNK];
  __shared__ bool merge;
  __shared__ float qs[GROUP + 1][HEAD_DIM];  // fused decode: QK-norm/RoPE exchange, then the queries
  __shared__ float nsh[GROUP + 1][32];
  __shared__ int sbt[ATT_SBT];  // block-table entries: the whole context's when they fit, else one chunk's
  __shared__ __align__(16) unsigned char pool[ATT_POOL_BYTES];
  float(*red)[GROUP][HEAD_DIM] = reinterpret_cast<float(*)[GROUP][HEAD_DIM]>(pool);  // after the key loop
  act_t* tiles = reinterpret_cast<act_t*>(pool);  // during it (ATT_ASYNC)
  __shared__ float chunk_m[GROUP], chunk_s[GROUP];
  pdl_wait_then_trigger();  // positions, slots and q/k/v come from earlier kernels of the step
  const int t = blockIdx.x, kvh = blockIdx.y, NH = NKV * GROUP;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int p = pos[t];
  const int ctx_start = window > 0 ? max(0, p - window + 1) : 0;
  const int per = (p + 1 - ctx_start + n_split - 1) / n_split;  // keys per split
  const int start = min(p + 1, ctx_start + (int)blockIdx.z * per), end = min(p + 1, start + per);
  const bool owner = start <= p && p < end;  // the split holding this step's own key writes it
  const int* bt = block_tables + (size_t)tok_row[t] * max_blocks;
  // chunk_m holds the running max after each chunk; the softmax warps read it back (a register array
  // indexed by the warp number would go to local memory)
  if (threadIdx.x < GROUP) chunk_m[threadIdx.x] = -INFINITY;
  // stage the block-table entries of the whole context at once when they fit (a decode step's usual case),
  // so their load overlaps the prologue instead of costing a memory latency per chunk
  const int first_block = start / block_size, n_blocks = end > start ? (end - 1) / block_size - first_block + 1 : 0;
  const bool whole = n_blocks <= ATT_SBT;
  if (whole)
    for (int i = threadIdx.x; i < n_blocks; i += blockDim.x) sbt[i] = bt[first_block + i];

  if (qkv) {
    // fused decode step (qkv != null): each token is its own sequence's only query, so this CTA can do the
    // token's QK-norm, RoPE and KV write itself and then read the cache (its own key included) after a barrier.
    // Written for one KV head (Gemma 3).
    const float* row = qkv + (size_t)t * (GROUP + 2) * HEAD_DIM;
    const int d = threadIdx.x, half_d = HEAD_DIM / 2;
    float x[GROUP + 1], w[GROUP + 1];
#pragma unroll
    for (int h = 0; h <= GROUP; h++) {
      x[h] = row[h * HEAD_DIM + d];
      w[h] = h < GROUP ? qn_w[d] : kn_w[d];
    }
    const float v = row[(GROUP + 1) * HEAD_DIM + d];
    const float c = rcos[(size_t)p * half_d + d % half_d], s = rsin[(size_t)p * half_d + d % half_d];
    const size_t slot = (size_t)slots[t];
    norm_rope_heads<GROUP + 1>(x, w, c, s, eps, qs, nsh);
    __syncthreads();  // every partner read of qs is done before qs is overwritten with the results
#pragma unroll
    for (int g = 0; g < GROUP; g++) qs[g][d] = x[g];
    if (owner) {
      kc[slot * HEAD_DIM + d] = from_f(x[GROUP]);
      vc[slot * HEAD_DIM + d] = from_f(v);
    }
    __syncthreads();  // the K/V writes and qs are visible to the whole block
  }
  float qr[GROUP][LANE_DIMS], acc[GROUP][LANE_DIMS], m[GROUP], l[GROUP];
#pragma unroll
  for (int g = 0; g < GROUP; g++) {
    if (qkv) {
#pragma unroll
      for (int e = 0; e < LANE_DIMS; e++) qr[g][e] = qs[g][lane * LANE_DIMS + e];
    } else {
      load_lane(q + ((size_t)t * NH + kvh * GROUP + g) * HEAD_DIM + lane * LANE_DIMS, qr[g]);
    }
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
    // otherwise the chunk's block-table entries, once, so each key costs one dependent load instead of two
    int b0 = first_block;
    if (!whole) {
      b0 = c0 / block_size;
      const int nb = (c0 + n - 1) / block_size - b0 + 1;
      __syncthreads();  // the previous chunk's readers of sbt are done
      for (int i = threadIdx.x; i < nb; i += blockDim.x) sbt[i] = bt[b0 + i];
    }
    __syncthreads();
#if ATT_ASYNC
    // keys, then values, in tiles of ATT_TILE copied to shared memory by cp.async into ATT_STAGES buffers: the next
    // tiles are in flight while one is used, and no register waits for a key (the register-bound loads of the other
    // path keep few bytes in flight a block, so its reads run far below the memory's rate at full batches: NOTES.md)
    const int n_tiles = (n + ATT_TILE - 1) / ATT_TILE;
#pragma unroll
    for (int s = 0; s < ATT_STAGES - 1; s++)
      att_copy_tile(s, n_tiles, n, c0, b0, block_size, NKV, kvh, kc, vc, sbt, tiles);
    for (int s = 0; s < 2 * n_tiles; s++) {
      cp_async_wait<ATT_STAGES - 2>();  // this thread's copies of tile s have landed
      __syncthreads();  // everyone's have, and everyone is done with tile s - 1; at s = n_tiles every score is in sc
      // into tile s - 1's buffer, free now
      att_copy_tile(s + ATT_STAGES - 1, n_tiles, n, c0, b0, block_size, NKV, kvh, kc, vc, sbt, tiles);
      if (s == n_tiles) att_softmax(sc, n, chunk_m, chunk_s, m, l, acc);
      const act_t* tile = tiles + (s % ATT_STAGES) * ATT_TILE * HEAD_DIM;
      const int j0 = (s < n_tiles ? s : s - n_tiles) * ATT_TILE + warp;
      float f[ATT_UNROLL][LANE_DIMS];
#pragma unroll
      for (int u = 0; u < ATT_UNROLL; u++)
        if (j0 + u * ATT_WARPS < n) load_lane(tile + (warp + u * ATT_WARPS) * HEAD_DIM + lane * LANE_DIMS, f[u]);
      if (s < n_tiles)
        att_scores(qr, f, j0, n, sc);
      else
        att_pv(acc, f, j0, n, sc);
    }
    __syncthreads();  // the last tile is read before the pool is reused (the warps' sums, the next chunk's tiles)
#else
    // scores: ATT_UNROLL keys per warp per iteration, all loads issued before the first use (each key's
    // block-table lookup and 16-byte load would otherwise be one full memory latency apiece)
    for (int j0 = warp; j0 < n; j0 += ATT_WARPS * ATT_UNROLL) {
      float kf[ATT_UNROLL][LANE_DIMS];
#pragma unroll
      for (int u = 0; u < ATT_UNROLL; u++) {
        const int j = j0 + u * ATT_WARPS;
        if (j < n) {
          const int kp = c0 + j;
          const size_t slot = (size_t)sbt[kp / block_size - b0] * block_size + kp % block_size;
          load_lane(kc + (slot * NKV + kvh) * HEAD_DIM + lane * LANE_DIMS, kf[u]);
        }
      }
      att_scores(qr, kf, j0, n, sc);
    }
    __syncthreads();
    att_softmax(sc, n, chunk_m, chunk_s, m, l, acc);
    // P.V, loads batched the same way
    for (int j0 = warp; j0 < n; j0 += ATT_WARPS * ATT_UNROLL) {
      float vf[ATT_UNROLL][LANE_DIMS];
#pragma unroll
      for (int u = 0; u < ATT_UNROLL; u++) {
        const int j = j0 + u * ATT_WARPS;
        if (j < n) {
          const int kp = c0 + j;
          const size_t slot = (size_t)sbt[kp / block_size - b0] * block_size + kp % block_size;
          load_lane(vc + (slot * NKV + kvh) * HEAD_DIM + lane * LANE_DIMS, vf[u]);
        }
      }
      att_pv(acc, vf, j0, n, sc);
    }
    __syncthreads();  // sc is overwritten by the next chunk
#endif
  }
  // combine the warps' partial sums
#pragma unroll
  for (int g = 0; g < GROUP; g++)
#pragma unroll
    for (int e = 0; e < LANE_DIMS; e++) red[warp][g][lane * LANE_DIMS + e] = acc[g][e];
  __syncthreads();
  const size_t out_row = ((size_t)t * NH + kvh * GROUP) * HEAD_DIM;
  if (n_split == 1) {
    for (int o = threadIdx.x; o < GROUP * HEAD_DIM; o += blockDim.x) {
      const int g = o / HEAD_DIM, d = o % HEAD_DIM;
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < ATT_WARPS; w++) s += red[w][g][d];
      out[out_row + o] = from_f(s / l[g]);
    }
    return;
  }
  // split: this block's partial (unnormalised acc, then max and sum per head), then the last block merges
  const int stride = GROUP * HEAD_DIM + 2 * GROUP;
  float* mine = part + ((size_t)t * n_split + blockIdx.z) * stride;
  for (int o = threadIdx.x; o < GROUP * HEAD_DIM; o += blockDim.x) {
    const int g = o / HEAD_DIM, d = o % HEAD_DIM;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++) s += red[w][g][d];
    mine[o] = s;
  }
#pragma unroll
  for (int g = 0; g < GROUP; g++)
    if (threadIdx.x == g) {
      mine[GROUP * HEAD_DIM + g] = m[g];
      mine[GROUP * HEAD_DIM + GROUP + g] = l[g];
    }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) merge = atomicAdd(counter + t, 1u) == (unsigned)n_split - 1;
  __syncthreads();
  if (!merge) return;
  __threadfence();
  const float* all = part + (size_t)t * n_split * stride;
  for (int o = threadIdx.x; o < GROUP * HEAD_DIM; o += blockDim.x) {
    const int g = o / HEAD_DIM;
    float mx = -INFINITY;
    for (int z = 0; z < n_split; z++) mx = fmaxf(mx, __ldcg(all + z * stride + GROUP * HEAD_DIM + g));
    float sum = 0.f, s = 0.f;
    for (int z = 0; z < n_split; z++) {
      const float* pz = all + z * stride;
      const float w = __expf(__ldcg(pz + GROUP * HEAD_DIM + g) - mx);  // 0 for an empty split (max -inf)
      sum += __ldcg(pz + GROUP * HEAD_DIM + GROUP + g) * w;
      s += __ldcg(pz + o) * w;
    }
    out[out_row + o] = from_f(s / sum);
  }
  if (threadIdx.x == 0) counter[t] = 0;  // ready for the next step (graph replay)
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

