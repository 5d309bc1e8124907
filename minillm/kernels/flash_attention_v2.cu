// flash_attention_v2.cu -- the same FlashAttention forward pass as flash_attention.cu, organized the
// way fast GPU kernels are (as in llm.c's and FlashAttention-2's CUDA code), float32 on CUDA cores.
//
//     O = softmax(Q K^T * scale + causal mask) V          L = log sum_j exp(S_ij)   (one per query row)
//
// flash_attention.cu (v1) is the version to read first: one thread per query row, one warp per block.
// This file changes how the work is spread over the GPU, not the math:
//
//   v1                                         v2 (this file)
//   one warp per block, 32 query rows           4 warps per block, 64 query rows x 64 keys per tile
//   a thread owns a whole row: every FMA        a lane owns a 4 x 8 register tile of S and a 4 x HS/8
//     needs two scalar shared-memory loads        tile of O: 12 128-bit loads feed 128 FMAs
//   row max and sum in one thread               row max reduced across the row's 8 lanes with
//                                                 __shfl_xor_sync; the row sum only once, at the end
//   head size a runtime argument                HS a template constant (32, 64, 128): loops unroll and
//                                                 the tiles live in registers; smaller heads are padded
//   48 KiB of shared memory                     up to 115 KiB (opts in above 48 KiB)
//   query tiles in order                        the heaviest causal tiles (the last rows) start first
//
// Who owns what (one block = Q tile i of one head; lane = threadIdx.x % 32, warp = threadIdx.x / 32):
//   warp w          query rows w*16 .. w*16+15 of the tile
//   lane (ry, cx)   ry = lane / 8, cx = lane % 8:
//                   its rows   w*16 + ry + 4a,  a = 0..3
//                   its keys   cx + 8b,          b = 0..7   (of each 64-key tile)
//                   its dims   4cx + 32t .. +3,  t = 0..HS/32-1  (float4 chunks of O's columns)
//   The 8 lanes of one ry hold one row's 64 scores between them: a row's max is 3 shuffles away.
//
// Shared memory, in floats (rows padded by 4 floats, so that the 8 lanes that read 8 different rows at
// the same column hit 8 different groups of 4 banks, and every row stays 16-byte aligned):
//   Q_i  64 x (HS+4)    K_j  64 x (HS+4)    V_j  64 x HS    P  64 x (64+4) (each warp its 16 rows)
//
// Launch (minillm/kernels/launch.py): grid (Tr, nh, B), block (128,), dynamic shared memory
// flash2_smem_floats(HS) * 4 bytes; kernels flash_attention_v2_hs32 / _hs64 / _hs128.
// Builds like v1: NVRTC (cupy.RawKernel), nvcc (the resource report), g++ -include cuda_emu.h (CPU).

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

#define V2_THREADS 128  // threads per block: 4 warps
#define V2_BR 64        // query rows per block (16 per warp)
#define V2_BC 64        // keys per tile
#define V2_PAD 4        // floats of padding after each row of Q_i, K_j and P

// status codes written to *status (0 = success); the launcher turns them into exceptions
#define FLASH2_OK 0
#define FLASH2_BAD_BLOCK 1       // the block is not (128, 1, 1)
#define FLASH2_SMEM_TOO_SMALL 2  // the launch gave less dynamic shared memory than the tiles need
#define FLASH2_MISALIGNED 3      // Q, K, V or O is not 16-byte aligned (the float4 loads need it)

#define FULL_MASK 0xffffffffu  // every lane of the warp takes part in a shuffle

template <int HS>
__device__ __forceinline__ unsigned int flash2_smem_floats() {
    return (V2_BR + V2_BC) * (HS + V2_PAD) + V2_BC * HS + V2_BR * (V2_BC + V2_PAD);
}

#ifndef CUDA_EMU
__device__ __forceinline__ unsigned int dynamic_smem_size() {
    unsigned int bytes;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    return bytes;
}
#endif

__device__ __forceinline__ float component(const float4& v, int c) {  // v.x, v.y, v.z, v.w by index
    return c == 0 ? v.x : c == 1 ? v.y : c == 2 ? v.z : v.w;
}

// max over the 8 lanes that share a row (lanes differing in their 3 low bits): 3 butterfly steps
__device__ __forceinline__ float row_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, 1));
    x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, 2));
    return fmaxf(x, __shfl_xor_sync(FULL_MASK, x, 4));
}

__device__ __forceinline__ float row_sum(float x) {
    x += __shfl_xor_sync(FULL_MASK, x, 1);
    x += __shfl_xor_sync(FULL_MASK, x, 2);
    return x + __shfl_xor_sync(FULL_MASK, x, 4);
}

template <int HS>
__device__ void flash_attention_v2(const float* __restrict__ Q, const float* __restrict__ K,
                                   const float* __restrict__ V, float* __restrict__ O, float* __restrict__ L,
                                   int* __restrict__ status, const int Tq, const int Tk, const int causal,
                                   const float scale) {
    extern __shared__ float sram[];
    constexpr int QS = HS + V2_PAD;    // row stride of Q_i and K_j
    constexpr int PS = V2_BC + V2_PAD; // row stride of P
    constexpr int C4 = HS / 4;         // float4 chunks per row
    constexpr int T4 = HS / 32;        // float4 chunks of O per lane
    const int tid = threadIdx.x;

    // 0. limits; the same for every thread, so the whole block returns together
    int err = FLASH2_OK;
    if (blockDim.x != V2_THREADS || blockDim.y != 1 || blockDim.z != 1) err = FLASH2_BAD_BLOCK;
    else if (flash2_smem_floats<HS>() * sizeof(float) > dynamic_smem_size()) err = FLASH2_SMEM_TOO_SMALL;
    else if (((unsigned long long)Q | (unsigned long long)K | (unsigned long long)V | (unsigned long long)O) & 15)
        err = FLASH2_MISALIGNED;
    if (err != FLASH2_OK) {
        if (tid == 0) *status = err;
        return;
    }

    const int warp = tid / 32, lane = tid % 32;
    const int ry = lane / 8, cx = lane % 8;
    const int i = gridDim.x - 1 - blockIdx.x;  // the last query tiles see the most keys: start them first
    const long long bh = (long long)blockIdx.z * gridDim.y + blockIdx.y;
    const float* Qbh = Q + bh * Tq * HS;
    const float* Kbh = K + bh * Tk * HS;
    const float* Vbh = V + bh * Tk * HS;
    float* Obh = O + bh * Tq * HS;

    float* Qi = sram;                 // 64 x QS
    float* Kj = Qi + V2_BR * QS;      // 64 x QS
    float* Vj = Kj + V2_BC * QS;      // 64 x HS
    float* Pw = Vj + V2_BC * HS + warp * 16 * PS;  // this warp's 16 rows of P (64 x PS in all)
    const int wrow = warp * 16 + ry;  // this lane's first row in the tile; the others are +4, +8, +12

    // 1. Q_i -> shared memory, 128-bit loads, consecutive threads on consecutive chunks (coalesced)
    for (int e = tid; e < V2_BR * C4; e += V2_THREADS) {
        const int r = e / C4, c = e % C4, qr = i * V2_BR + r;
        const float4 q = qr < Tq ? reinterpret_cast<const float4*>(Qbh + (long long)qr * HS)[c]
                                 : make_float4(0.0f, 0.0f, 0.0f, 0.0f);  // tail rows: zeros, never stored
        *reinterpret_cast<float4*>(Qi + r * QS + 4 * c) = q;
    }
    __syncthreads();  // Q_i is complete before any lane reads rows other threads stored

    float o[4][4 * T4];  // this lane's 4 rows x HS/8 columns of the running, unnormalized O
    float m[4], l[4];    // running row max (the same in the row's 8 lanes) and this lane's part of the row sum
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        m[a] = -INFINITY;
        l[a] = 0.0f;
#pragma unroll
        for (int x = 0; x < 4 * T4; ++x) o[a][x] = 0.0f;
    }

    // causal tile skipping: no row of this tile sees a key past the last row's position
    const int last_row = min((i + 1) * V2_BR, Tq) - 1;
    const int k_end = causal ? min(Tk, (Tk - Tq) + last_row + 1) : Tk;
    const int Tc = (k_end + V2_BC - 1) / V2_BC;

    for (int j = 0; j < Tc; ++j) {
        // 2. K_j, V_j -> shared memory (coalesced 128-bit loads; key rows past Tk read nothing)
        for (int e = tid; e < V2_BC * C4; e += V2_THREADS) {
            const int r = e / C4, c = e % C4, kr = j * V2_BC + r;
            const bool in_bounds = kr < Tk;
            const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            *reinterpret_cast<float4*>(Kj + r * QS + 4 * c) =
                in_bounds ? reinterpret_cast<const float4*>(Kbh + (long long)kr * HS)[c] : zero;
            *reinterpret_cast<float4*>(Vj + r * HS + 4 * c) =
                in_bounds ? reinterpret_cast<const float4*>(Vbh + (long long)kr * HS)[c] : zero;
        }
        __syncthreads();  // K_j, V_j complete before any lane reads them

        // 3. this lane's 4 x 8 scores: per 4 columns, 4 + 8 float4 loads feed 4 x 8 x 4 = 128 FMAs
        float s[4][8];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 8; ++b) s[a][b] = 0.0f;
#pragma unroll 4
        for (int x = 0; x < HS; x += 4) {
            float4 qv[4], kv[8];
#pragma unroll
            for (int a = 0; a < 4; ++a) qv[a] = *reinterpret_cast<const float4*>(Qi + (wrow + 4 * a) * QS + x);
#pragma unroll
            for (int b = 0; b < 8; ++b) kv[b] = *reinterpret_cast<const float4*>(Kj + (cx + 8 * b) * QS + x);
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int b = 0; b < 8; ++b) {
                    s[a][b] = fmaf(qv[a].x, kv[b].x, s[a][b]);
                    s[a][b] = fmaf(qv[a].y, kv[b].y, s[a][b]);
                    s[a][b] = fmaf(qv[a].z, kv[b].z, s[a][b]);
                    s[a][b] = fmaf(qv[a].w, kv[b].w, s[a][b]);
                }
        }

        // 4. online softmax per row: mask, the row's max over its 8 lanes, rescale, P = exp(S - m)
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const int q_pos = (Tk - Tq) + i * V2_BR + wrow + 4 * a;  // the query's absolute position
            float m_tile = -INFINITY;
#pragma unroll
            for (int b = 0; b < 8; ++b) {
                const int key = j * V2_BC + cx + 8 * b;
                const bool visible = key < Tk && (!causal || key <= q_pos);
                s[a][b] = visible ? s[a][b] * scale : -INFINITY;
                m_tile = fmaxf(m_tile, s[a][b]);
            }
            const float m_new = fmaxf(m[a], row_max(m_tile));
            const float m_ref = (m_new == -INFINITY) ? 0.0f : m_new;  // no visible key yet: keep exp() finite
            const float alpha = expf(m[a] - m_ref);                  // exp(m_old - m_new) <= 1
            m[a] = m_new;
            l[a] *= alpha;  // each lane rescales its own part of the sum: alpha is the same for the whole row
#pragma unroll
            for (int x = 0; x < 4 * T4; ++x) o[a][x] *= alpha;
#pragma unroll
            for (int b = 0; b < 8; ++b) {
                const float p = expf(s[a][b] - m_ref);  // masked -> exp(-inf) = 0
                l[a] += p;
                Pw[(ry + 4 * a) * PS + cx + 8 * b] = p;
            }
        }
        __syncwarp();  // the warp's P rows are complete before its lanes read each other's entries

        // 5. O += P V_j: per 4 keys, 4 float4 loads of P and 4 x HS/32 of V feed 4 x 4 x HS/8 FMAs
#pragma unroll 2
        for (int c = 0; c < V2_BC; c += 4) {
            float4 pv[4];
#pragma unroll
            for (int a = 0; a < 4; ++a) pv[a] = *reinterpret_cast<const float4*>(Pw + (ry + 4 * a) * PS + c);
#pragma unroll
            for (int cc = 0; cc < 4; ++cc)
#pragma unroll
                for (int t = 0; t < T4; ++t) {
                    const float4 v = *reinterpret_cast<const float4*>(Vj + (c + cc) * HS + 4 * cx + 32 * t);
#pragma unroll
                    for (int a = 0; a < 4; ++a) {
                        const float p = component(pv[a], cc);
                        o[a][4 * t + 0] = fmaf(p, v.x, o[a][4 * t + 0]);
                        o[a][4 * t + 1] = fmaf(p, v.y, o[a][4 * t + 1]);
                        o[a][4 * t + 2] = fmaf(p, v.z, o[a][4 * t + 2]);
                        o[a][4 * t + 3] = fmaf(p, v.w, o[a][4 * t + 3]);
                    }
                }
        }
        __syncthreads();  // all reads of K_j, V_j and P are done before the next tile overwrites them
    }

    // 6. the row sums (once, across the row's 8 lanes), then O / l and L straight from registers
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const float l_row = row_sum(l[a]);  // every lane calls the shuffle, also for rows past Tq
        const int row = i * V2_BR + wrow + 4 * a;
        if (row < Tq) {
            const float inv_l = 1.0f / l_row;
#pragma unroll
            for (int t = 0; t < T4; ++t)
                *reinterpret_cast<float4*>(Obh + (long long)row * HS + 4 * cx + 32 * t) =
                    make_float4(o[a][4 * t] * inv_l, o[a][4 * t + 1] * inv_l, o[a][4 * t + 2] * inv_l,
                                o[a][4 * t + 3] * inv_l);
            if (cx == 0) L[bh * Tq + row] = m[a] + logf(l_row);
        }
    }
}

// one entry point per head size (extern "C": the names NVRTC and the emulator look up)
#define FLASH2_ENTRY(HS)                                                                                     \
    extern "C" __global__ void __launch_bounds__(V2_THREADS) flash_attention_v2_hs##HS(                       \
        const float* Q, const float* K, const float* V, float* O, float* L, int* status, const int Tq,       \
        const int Tk, const int causal, const float scale) {                                                 \
        flash_attention_v2<HS>(Q, K, V, O, L, status, Tq, Tk, causal, scale);                                \
    }
FLASH2_ENTRY(32)
FLASH2_ENTRY(64)
FLASH2_ENTRY(128)
