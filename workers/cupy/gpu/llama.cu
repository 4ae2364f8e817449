// Llama-family kernels for one engine step, beside the shared ones in kernels.cu (embed_norm, paged attention,
// argmax, graph input preparation). Compiled into one module with common.cuh, kernels.cu and sampling.cu by
// workers/cupy/gpu/llama.py, with HEAD_DIM the model's head size and GROUP its query heads per KV head.

// Llama's pre-norm residual at a layer boundary, fused:
//   resid[src] += delta[src];  out[blockIdx] = rmsnorm(resid[src]) * w
// rows == nullptr: src = blockIdx.x and resid is updated in place. rows != nullptr (the final norm before
// the output head): src = rows[blockIdx.x], only the selected rows are computed and resid is left alone.
// Dynamic shared memory: H floats (each thread reads back only what it wrote).
extern "C" __global__ void residual_norm(float* __restrict__ resid, const float* __restrict__ delta,
                                         const float* __restrict__ w, const long long* __restrict__ rows,
                                         float eps, int H, act_t* __restrict__ out) {
  extern __shared__ float buf[];
  __shared__ float sh[32];
  const size_t src = rows ? (size_t)rows[blockIdx.x] : (size_t)blockIdx.x;
  const float* d = delta + src * H;
  float* r = resid + src * H;
  float ss = 0.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const float v = r[i] + d[i];
    buf[i] = v;
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss, sh) / H + eps);
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    if (!rows) r[i] = buf[i];
    out[(size_t)blockIdx.x * H + i] = from_f(buf[i] * inv * w[i]);
  }
}

// After the fused q/k/v product (fp32): RoPE on the NH query and NKV key heads (split-halves layout: the model
// un-permuted llama.cpp's q/k rows at load), q written for attention, k and v into the paged cache at the
// token's slot. One block per token; threads stride over heads x dims, reading the fp32 row (no exchange).
extern "C" __global__ void rope_qkv(const float* __restrict__ qkv, const int* __restrict__ pos,
                                    const long long* __restrict__ slots, const float* __restrict__ rcos,
                                    const float* __restrict__ rsin, int NH, int NKV, act_t* __restrict__ q_out,
                                    act_t* __restrict__ kc, act_t* __restrict__ vc) {
  const size_t t = blockIdx.x;
  const int half_d = HEAD_DIM / 2, rotated = (NH + NKV) * HEAD_DIM;
  const float* row = qkv + t * (size_t)(rotated + NKV * HEAD_DIM);
  const size_t p = pos[t];
  const size_t slot = (size_t)slots[t];
  for (int i = threadIdx.x; i < rotated; i += blockDim.x) {
    const int h = i / HEAD_DIM, d = i % HEAD_DIM, j = d % half_d;
    const float c = rcos[p * half_d + j], s = rsin[p * half_d + j];
    const float x = row[i];
    const float partner = row[h * HEAD_DIM + (d < half_d ? d + half_d : d - half_d)];
    const float y = d < half_d ? x * c - partner * s : x * c + partner * s;
    if (h < NH)
      q_out[t * NH * HEAD_DIM + i] = from_f(y);
    else
      kc[slot * NKV * HEAD_DIM + (i - NH * HEAD_DIM)] = from_f(y);
  }
  for (int i = threadIdx.x; i < NKV * HEAD_DIM; i += blockDim.x)
    vc[slot * NKV * HEAD_DIM + i] = from_f(row[rotated + i]);
}

// out[t, f] = silu(gu[t, f]) * gu[t, F + f]   (gate and up come from one product)
extern "C" __global__ void silu_mul(const float* __restrict__ gu, int F, long long n, act_t* __restrict__ out) {
  for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < n;
       idx += (long long)gridDim.x * blockDim.x) {
    const long long t = idx / F, f = idx % F;
    const float g = gu[t * 2 * F + f], u = gu[t * 2 * F + F + f];
    out[idx] = from_f(g / (1.f + expf(-g)) * u);
  }
}
