// fused.cu -- the elementwise and row-wise work of one decode step, one kernel launch each.
//
// A decode step of a small model is bound by kernel launches, not by arithmetic: written as array code,
// one LayerNorm is eleven launches (sum, divide, subtract, square, sum, ...), one GELU eight. Each kernel
// below does one such group of operations in a single launch, reading its inputs once. The array code it
// replaces stays the reference (minillm/fused.py names each one, and the tests compare them).
//
// One warp (FUSED_THREADS = 32 threads) per token row r = b * T + t: a decode step has few rows, and 32 threads
// share out a row of a few hundred columns.
//
//   kernel                            grid          what it computes (per token row r)
//   embed_rows / embed_pos_rows       (rows)        pos[r] = lengths[b] + t;  x[r] = wte[ids[r]] (+ wpe[pos[r]])
//   layer_norm_rows / rms_norm_rows   (rows)        out[r] = norm(x[r])
//   add_layer_norm_rows / add_rms_..  (rows)        x[r] += y[r] + bias;  out[r] = norm(x[r])
//   bias_gelu                         (rows)        h[r] = gelu(h[r] + bias)                     (in place)
//   silu_mul                          (rows)        a[r] = silu(gu[r, :H]) * gu[r, H:]
//   qkv_to_cache / qkv_rope_to_cache  (rows)        split q | k | v (+ bias, or RoPE on q and k); q to its buffer,
//                                                   k and v into the cache at position pos[r]
//   decode_attention                  (T, nh, B)    out[r, head] = softmax(q k^T / sqrt(hs)) v over keys 0..pos[r]
//
// A kernel that meets an input it cannot take (a token id outside the vocabulary, a position past the cache,
// a head larger than HS_MAX) writes its FUSED_* code to *status and returns; the host reads the word when it
// next waits for the device anyway.
#define FUSED_THREADS 32  // threads per block: one warp per token row
#define HS_MAX 128        // largest head size decode_attention holds in registers
#define FUSED_OK 0
#define FUSED_BAD_TOKEN 1       // a token id outside 0..V-1
#define FUSED_PAST_CACHE 2      // a position outside 0..max_len-1 of the cache
#define FUSED_HEAD_TOO_LARGE 3  // head size above HS_MAX

#ifndef INFINITY  // NVRTC (cupy.RawKernel) has no <math.h>
#define INFINITY __int_as_float(0x7f800000)
#endif

#define GELU_C 0.7978845608028654f  // sqrt(2 / pi)
#define GELU_A 0.044715f            // the cubic coefficient of GPT-2's tanh approximation

// The sum of v over the block's FUSED_THREADS threads, in every thread: each parks its value in its slot of
// `slots` (shared memory), one barrier, then each adds up all of them. (Five __shfl_xor_sync steps would do it
// without shared memory; one barrier is ten times fewer waits for the CPU emulation.) A second sum in the same
// kernel uses other slots: a thread may still be reading these when a faster one writes its next value.
__device__ __forceinline__ float block_sum(float v, float* slots) {
    slots[threadIdx.x] = v;
    __syncthreads();  // every thread's value is in shared memory before any thread adds them up
    float total = 0.0f;
    for (int i = 0; i < FUSED_THREADS; ++i) total += slots[i];
    return total;
}

// ---- the step's prologue: positions and token embeddings ----------------------------------------------

template <bool WPE>
__device__ void embed_row(const int* ids, const int* lengths, const float* wte, const float* wpe, float* x, int* pos,
                          int* status, int T, int C, int V, int max_len) {
    const int r = blockIdx.x, b = r / T, t = r % T;
    const int p = lengths[b] + t;  // the row's absolute position: read from the device, never baked in
    const int id = ids[r];
    if (id < 0 || id >= V || p < 0 || p >= max_len) {
        if (threadIdx.x == 0) *status = (id < 0 || id >= V) ? FUSED_BAD_TOKEN : FUSED_PAST_CACHE;
        return;
    }
    if (threadIdx.x == 0) pos[r] = p;
    for (int c = threadIdx.x; c < C; c += FUSED_THREADS)
        x[(long long)r * C + c] = wte[(long long)id * C + c] + (WPE ? wpe[(long long)p * C + c] : 0.0f);
}

// Llama: x = embed_tokens[ids] (RoPE carries the position)
extern "C" __global__ void embed_rows(const int* ids, const int* lengths, const float* wte, float* x, int* pos,
                                      int* status, int T, int C, int V, int max_len) {
    embed_row<false>(ids, lengths, wte, wte, x, pos, status, T, C, V, max_len);
}

// GPT-2: x = wte[ids] + wpe[pos]
extern "C" __global__ void embed_pos_rows(const int* ids, const int* lengths, const float* wte, const float* wpe,
                                          float* x, int* pos, int* status, int T, int C, int V, int max_len) {
    embed_row<true>(ids, lengths, wte, wpe, x, pos, status, T, C, V, max_len);
}

// ---- norms, with the residual add folded in -------------------------------------------------------------

// LayerNorm:  out = (x - mean) / sqrt(var + eps) * w + b        RMSNorm:  out = x / sqrt(mean(x^2) + eps) * w
// With RESIDUAL the row first becomes x + y (+ bias: GPT-2 only), the residual stream, written back to x: the
// add that ends one sublayer and the norm that starts the next are one launch. Shared: NORM_SMEM_FLOATS floats.
#define NORM_SMEM_FLOATS 64  // two sums' slots, FUSED_THREADS each
template <bool RMS, bool RESIDUAL>
__device__ void norm_row(float* x, const float* y, const float* bias, const float* w, const float* b, float* out,
                         int C, float eps) {
    extern __shared__ float sram[];
    const int lane = threadIdx.x;
    float* xr = x + (long long)blockIdx.x * C;
    // pass 1 (RESIDUAL only): x <- x + y + bias; each lane writes the columns it reads below, so no barrier
    if (RESIDUAL) {
        const float* yr = y + (long long)blockIdx.x * C;
        for (int c = lane; c < C; c += FUSED_THREADS) xr[c] += yr[c] + (RMS ? 0.0f : bias[c]);  // Llama: no bias
    }
    // pass 2 (LayerNorm only): the mean
    float mean = 0.0f;
    if (!RMS) {
        float s = 0.0f;
        for (int c = lane; c < C; c += FUSED_THREADS) s += xr[c];
        mean = block_sum(s, sram) / C;
    }
    // pass 3: the variance around the mean (LayerNorm), the mean square (RMSNorm: mean = 0)
    float s = 0.0f;
    for (int c = lane; c < C; c += FUSED_THREADS) {
        const float d = xr[c] - mean;
        s += d * d;
    }
    const float inv_std = 1.0f / sqrtf(block_sum(s, sram + FUSED_THREADS) / C + eps);
    // pass 4: normalize, scale, shift
    float* o = out + (long long)blockIdx.x * C;
    for (int c = lane; c < C; c += FUSED_THREADS) o[c] = (xr[c] - mean) * inv_std * w[c] + (RMS ? 0.0f : b[c]);
}

extern "C" __global__ void layer_norm_rows(float* x, const float* w, const float* b, float* out, int C, float eps) {
    norm_row<false, false>(x, x, x, w, b, out, C, eps);
}

extern "C" __global__ void rms_norm_rows(float* x, const float* w, float* out, int C, float eps) {
    norm_row<true, false>(x, x, x, w, w, out, C, eps);
}

extern "C" __global__ void add_layer_norm_rows(float* x, const float* y, const float* bias, const float* w,
                                               const float* b, float* out, int C, float eps) {
    norm_row<false, true>(x, y, bias, w, b, out, C, eps);
}

extern "C" __global__ void add_rms_norm_rows(float* x, const float* y, const float* w, float* out, int C, float eps) {
    norm_row<true, true>(x, y, w, w, w, out, C, eps);
}

// ---- activations ------------------------------------------------------------------------------------------

// GPT-2's MLP: h = gelu(h + bias), the tanh approximation 0.5 u (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3)))
extern "C" __global__ void bias_gelu(float* h, const float* bias, int H) {
    float* hr = h + (long long)blockIdx.x * H;
    for (int j = threadIdx.x; j < H; j += FUSED_THREADS) {
        const float u = hr[j] + bias[j];
        hr[j] = 0.5f * u * (1.0f + tanhf(GELU_C * (u + GELU_A * u * u * u)));
    }
}

// Llama's SwiGLU: a = silu(gate) * up, gate and up side by side in one row of gu (the stacked product);
// silu(g) = g * sigmoid(g) with sigmoid(g) = (1 + tanh(g / 2)) / 2, as minillm.llama.silu writes it
extern "C" __global__ void silu_mul(const float* gu, float* a, int H) {
    const float* row = gu + (long long)blockIdx.x * 2 * H;
    for (int j = threadIdx.x; j < H; j += FUSED_THREADS) {
        const float g = row[j];
        a[(long long)blockIdx.x * H + j] = g * (0.5f + 0.5f * tanhf(0.5f * g)) * row[H + j];
    }
}

// ---- q, k, v: split the product's row, place each part ---------------------------------------------------

// The row of the q|k|v product (q: nh heads, k and v: nkv heads each) goes to q (B, nh, T, hs) and, at position
// pos[r], to the caches (B, nkv, max_len, hs). GPT-2 adds the bias first; Llama rotates q and k (RoPE, the
// rotate-half layout of minillm.llama.apply_rope): dims d and d + hs/2 turn together by the angle
// pos * theta^(-2j/hs), j = d mod hs/2, computed in double as minillm.llama.rope_cos_sin does.
template <bool ROPE, bool BIAS>
__device__ void qkv_row(const float* qkv, const float* bias, const int* pos, float* q, float* kc, float* vc,
                        int* status, int T, int nh, int nkv, int hs, int max_len, float theta) {
    const int r = blockIdx.x, b = r / T, t = r % T, p = pos[r];
    if (p < 0 || p >= max_len) {
        if (threadIdx.x == 0) *status = FUSED_PAST_CACHE;
        return;
    }
    const int q_dim = nh * hs, kv_dim = nkv * hs, width = q_dim + 2 * kv_dim, half = hs / 2;
    const float* row = qkv + (long long)r * width;
    for (int c = threadIdx.x; c < width; c += FUSED_THREADS) {
        const int part = c < q_dim ? 0 : (c < q_dim + kv_dim ? 1 : 2);  // 0: q, 1: k, 2: v
        const int cc = c - (part == 0 ? 0 : (part == 1 ? q_dim : q_dim + kv_dim));
        const int head = cc / hs, d = cc % hs;
        float val = row[c] + (BIAS ? bias[c] : 0.0f);
        if (ROPE && part < 2) {
            const int j = d % half, partner = d < half ? c + half : c - half;
            const double angle = (double)p * pow((double)theta, -2.0 * j / hs);
            const float cs = (float)cos(angle), sn = (float)sin(angle);
            const float other = row[partner] + (BIAS ? bias[partner] : 0.0f);
            val = d < half ? val * cs - other * sn : val * cs + other * sn;  // (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)
        }
        if (part == 0) {
            q[(((long long)b * nh + head) * T + t) * hs + d] = val;
        } else {
            float* cache = part == 1 ? kc : vc;
            cache[(((long long)b * nkv + head) * max_len + p) * hs + d] = val;
        }
    }
}

extern "C" __global__ void qkv_to_cache(const float* qkv, const float* bias, const int* pos, float* q, float* kc,
                                        float* vc, int* status, int T, int nh, int nkv, int hs, int max_len) {
    qkv_row<false, true>(qkv, bias, pos, q, kc, vc, status, T, nh, nkv, hs, max_len, 0.0f);
}

extern "C" __global__ void qkv_rope_to_cache(const float* qkv, const int* pos, float* q, float* kc, float* vc,
                                             int* status, int T, int nh, int nkv, int hs, int max_len, float theta) {
    qkv_row<true, false>(qkv, qkv, pos, q, kc, vc, status, T, nh, nkv, hs, max_len, theta);
}

// ---- attention over the cache, reading the length from the device ----------------------------------------

// One warp per query (t, head, b): the query sits at position p = pos[b * T + t] and attends keys 0..p of its
// key/value head head / (nh / nkv) (grouped-query attention). The cache is read up to p, never to a length
// known on the host, so the launch is the same at every step (and can be replayed by a CUDA graph).
// Lane l takes keys l, l + 32, l + 64, ... and keeps the online softmax of chapter 4 over them: a running max
// m_l, a running sum l_l and an unnormalized output acc_l. The 32 partial results meet in shared memory:
//   M = max_l m_l,   L = sum_l l_l exp(m_l - M),   out = sum_l acc_l exp(m_l - M) / L.
// The output goes straight to the merged-heads layout (B, T, nh, hs) that the output projection reads.
extern "C" __global__ void decode_attention(const float* q, const float* kc, const float* vc, const int* pos,
                                            float* out, int* status, int T, int nh, int nkv, int hs, int max_len,
                                            float scale) {
    extern __shared__ float sram[];  // FUSED_THREADS x (hs + 2): each lane's acc, then its m and l
    const int t = blockIdx.x, head = blockIdx.y, b = blockIdx.z, lane = threadIdx.x;
    const int p = pos[b * T + t];
    if (hs > HS_MAX || p < 0 || p >= max_len) {  // the same for every thread of the block: no divergence
        if (lane == 0) *status = hs > HS_MAX ? FUSED_HEAD_TOO_LARGE : FUSED_PAST_CACHE;
        return;
    }
    const int kv_head = head / (nh / nkv);
    const float* qr = q + (((long long)b * nh + head) * T + t) * hs;
    const float* K = kc + ((long long)b * nkv + kv_head) * max_len * hs;
    const float* V = vc + ((long long)b * nkv + kv_head) * max_len * hs;
    float acc[HS_MAX];
    for (int d = 0; d < hs; ++d) acc[d] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int j = lane; j <= p; j += FUSED_THREADS) {
        float s = 0.0f;
        for (int d = 0; d < hs; ++d) s += qr[d] * K[(long long)j * hs + d];
        s *= scale;
        const float m_new = fmaxf(m, s);
        const float alpha = expf(m - m_new);  // rescales what was summed under the old max (0 at the first key)
        const float e = expf(s - m_new);
        l = alpha * l + e;
        for (int d = 0; d < hs; ++d) acc[d] = alpha * acc[d] + e * V[(long long)j * hs + d];
        m = m_new;
    }
    float* mine = sram + lane * (hs + 2);
    for (int d = 0; d < hs; ++d) mine[d] = acc[d];
    mine[hs] = m;  // -inf for a lane that had no key (p < lane): its weight exp(-inf - M) is 0
    mine[hs + 1] = l;
    __syncthreads();  // every lane's partial result is in shared memory before any lane reads the others'
    float M = -INFINITY;
    for (int i = 0; i < FUSED_THREADS; ++i) M = fmaxf(M, sram[i * (hs + 2) + hs]);
    float L = 0.0f;
    for (int i = 0; i < FUSED_THREADS; ++i) L += sram[i * (hs + 2) + hs + 1] * expf(sram[i * (hs + 2) + hs] - M);
    for (int d = lane; d < hs; d += FUSED_THREADS) {
        float o = 0.0f;
        for (int i = 0; i < FUSED_THREADS; ++i) o += sram[i * (hs + 2) + d] * expf(sram[i * (hs + 2) + hs] - M);
        out[(((long long)b * T + t) * nh + head) * hs + d] = o / L;
    }
}
