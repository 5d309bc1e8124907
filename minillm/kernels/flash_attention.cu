// flash_attention.cu -- the FlashAttention forward pass as one raw CUDA C kernel, float32.
//
//     O = softmax(Q K^T * scale + mask) V          L = log sum_j exp(S_ij)   (one per query row)
//
// computed tile by tile with the online softmax, so the Tq x Tk score matrix never exists in
// global memory (HBM): it lives one (Br x Bc) tile at a time in shared memory (SRAM).
//
// Notation of the FlashAttention papers (Dao et al. 2022, Algorithm 1; Dao 2023, Algorithm 1):
//   d        head size (hs), at most HS_MAX
//   Br, Bc   query rows / key rows per tile;  Br = blockDim.x: one thread owns one query row
//   Tr, Tc   number of query tiles (= gridDim.x) / key tiles
//   Q_i      the i-th query tile, K_j, V_j the j-th key and value tiles
//   S_i      scores of this tile, P_i = exp(S_i - m_i)
//   m_i, l_i running row max and running row sum of exp(S - m_i)     (registers)
//   O_i      running, *unnormalized* output; divided by l_i once at the end (FlashAttention-2)
//
// Launch (see minillm/kernels/launch.py):
//   grid (Tr, nh, B) -- one block per (query tile, head, batch element); block (Br);
//   dynamic shared memory flash_smem_floats(Br, Bc, d) * 4 bytes.
// Masks: causal=1 lets query row r (absolute position Tk - Tq + r) see keys 0..Tk - Tq + r.
// Any Tq <= Tk works: tiles past the end are bounds-checked (the "tail"), never read or written.
//
// The same file builds three ways, unchanged:
//   NVRTC (cupy.RawKernel)   -- no <math.h> there, hence the INFINITY definition below
//   nvcc -arch=sm_90 -c      -- the resource report: nvcc -Xptxas -v
//   g++ -include cuda_emu.h  -- CPU emulation, each block's threads as real threads (CI)
//
// Honest verdict: a teaching kernel. One thread per query row and FP32 FMAs on CUDA cores, no
// tensor cores, no warp-level parallelism inside a row; see docs/flash_attention.md for numbers.

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

#define HS_MAX 128  // largest head size this kernel accepts (the launcher's tile table covers 1..128)

// status codes written to *status (0 = success); the launcher turns them into exceptions
#define FLASH_OK 0
#define FLASH_BAD_HEAD_DIM 1       // d < 1 or d > HS_MAX
#define FLASH_BAD_BLOCK 2          // Bc < 1 or a 2-D/3-D block
#define FLASH_SMEM_TOO_SMALL 3     // the launch gave less dynamic shared memory than the tiles need

// Shared memory layout, in floats:
//   Q_i  Br x (d+1)   O_i  Br x (d+1)   K_j  Bc x d   V_j  Bc x d   S_i  Br x (Bc+1)
// Thread r walks row r of Q_i, O_i and S_i; the +1 padding puts rows r and r+1 in different
// banks (a stride of d = 64 floats would make all 32 threads of a warp hit the same bank).
// K_j and V_j are read at the same address by every thread (a broadcast), so they need no padding.
__device__ __forceinline__ unsigned int flash_smem_floats(int Br, int Bc, int d) {
    return 2u * Br * (d + 1) + 2u * Bc * d + (unsigned int)(Br * (Bc + 1));
}

#ifndef CUDA_EMU
// bytes of dynamic shared memory this launch was given (cuda_emu.h provides the CPU version)
__device__ __forceinline__ unsigned int dynamic_smem_size() {
    unsigned int bytes;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    return bytes;
}
#endif

extern "C" __global__ void flash_attention_forward(
    const float* __restrict__ Q,  // (B, nh, Tq, d)
    const float* __restrict__ K,  // (B, nh, Tk, d)
    const float* __restrict__ V,  // (B, nh, Tk, d)
    float* __restrict__ O,        // (B, nh, Tq, d)   output
    float* __restrict__ L,        // (B, nh, Tq)      log-sum-exp of each score row
    int* __restrict__ status,     // FLASH_OK, or the first limit this launch violates
    const int Tq, const int Tk, const int d, const int Bc, const int causal, const float scale) {
    extern __shared__ float sram[];
    const int Br = blockDim.x;
    const int tx = threadIdx.x;

    // 0. limits. The condition is the same for every thread of the block, so they all return
    //    together and no thread is left waiting at a __syncthreads() below.
    int err = FLASH_OK;
    if (d < 1 || d > HS_MAX) err = FLASH_BAD_HEAD_DIM;
    else if (Bc < 1 || blockDim.y != 1 || blockDim.z != 1) err = FLASH_BAD_BLOCK;
    else if (flash_smem_floats(Br, Bc, d) * sizeof(float) > dynamic_smem_size()) err = FLASH_SMEM_TOO_SMALL;
    if (err != FLASH_OK) {
        if (tx == 0) *status = err;
        return;
    }

    // this block's slice: query tile i of head blockIdx.y of batch element blockIdx.z
    const int i = blockIdx.x;
    const long long bh = (long long)blockIdx.z * gridDim.y + blockIdx.y;
    const float* Qbh = Q + bh * Tq * d;
    const float* Kbh = K + bh * Tk * d;
    const float* Vbh = V + bh * Tk * d;
    float* Obh = O + bh * Tq * d;

    const int ds = d + 1;        // padded row stride of Q_i and O_i
    const int ss = Bc + 1;       // padded row stride of S_i
    float* Qi = sram;            // Br x ds
    float* Oi = Qi + Br * ds;    // Br x ds
    float* Kj = Oi + Br * ds;    // Bc x d
    float* Vj = Kj + Bc * d;     // Bc x d
    float* Si = Vj + Bc * d;     // Br x ss

    const int row = i * Br + tx;          // this thread's query row; past Tq in a tail tile
    const bool row_valid = row < Tq;
    const int q_pos = (Tk - Tq) + row;    // its absolute position (queries are the last Tq positions)

    // 1. load Q_i and zero O_i. Consecutive threads read consecutive floats (coalesced).
    for (int e = tx; e < Br * d; e += Br) {
        const int r = e / d, c = e % d;
        const int qr = i * Br + r;
        Qi[r * ds + c] = (qr < Tq) ? Qbh[(long long)qr * d + c] : 0.0f;  // tail: rows past Tq read nothing
        Oi[r * ds + c] = 0.0f;
    }
    __syncthreads();  // Q_i was stored by all threads; each thread reads a whole row of it below

    float m_i = -INFINITY;  // running max of this row's scores
    float l_i = 0.0f;       // running sum of exp(score - m_i)

    // causal tile skipping: no row of this tile sees a key past the last row's position, so the
    // loop stops at that key tile (the same bound for every thread: barriers stay uniform)
    const int last_row = min((i + 1) * Br, Tq) - 1;
    const int k_end = causal ? min(Tk, (Tk - Tq) + last_row + 1) : Tk;
    const int Tc = (k_end + Bc - 1) / Bc;

    for (int j = 0; j < Tc; ++j) {
        // 2. stage K_j and V_j in shared memory, cooperatively and coalesced
        for (int e = tx; e < Bc * d; e += Br) {
            const int kr = j * Bc + e / d;
            const bool in_bounds = kr < Tk;  // tail: key rows past Tk read nothing
            Kj[e] = in_bounds ? Kbh[(long long)j * Bc * d + e] : 0.0f;
            Vj[e] = in_bounds ? Vbh[(long long)j * Bc * d + e] : 0.0f;
        }
        __syncthreads();  // K_j, V_j complete before any thread reads them

        if (row_valid) {
            // 3. S_i = scale * Q_i K_j^T for this row, with the causal mask and the tail masked to -inf
            float m_tile = -INFINITY;
            for (int c = 0; c < Bc; ++c) {
                const int key = j * Bc + c;
                float s = -INFINITY;
                if (key < Tk && (!causal || key <= q_pos)) {
                    float dot = 0.0f;
                    for (int x = 0; x < d; ++x) dot += Qi[tx * ds + x] * Kj[c * d + x];
                    s = dot * scale;
                }
                Si[tx * ss + c] = s;
                m_tile = fmaxf(m_tile, s);
            }

            // 4. online softmax: new max, rescale what was accumulated under the old max
            const float m_new = fmaxf(m_i, m_tile);
            const float m_ref = (m_new == -INFINITY) ? 0.0f : m_new;  // no visible key yet: keep exp() finite
            const float alpha = expf(m_i - m_ref);                     // exp(m_old - m_new) <= 1
            float l_tile = 0.0f;
            for (int c = 0; c < Bc; ++c) {
                const float p = expf(Si[tx * ss + c] - m_ref);  // P_i = exp(S_i - m_new); masked -> 0
                Si[tx * ss + c] = p;
                l_tile += p;
            }
            l_i = alpha * l_i + l_tile;
            m_i = m_new;

            // 5. O_i <- alpha * O_i + P_i V_j   (only this thread touches row tx of O_i)
            for (int x = 0; x < d; ++x) {
                float pv = 0.0f;
                for (int c = 0; c < Bc; ++c) pv += Si[tx * ss + c] * Vj[c * d + x];
                Oi[tx * ds + x] = alpha * Oi[tx * ds + x] + pv;
            }
        }
        __syncthreads();  // every thread is done with K_j, V_j before the next iteration overwrites them
    }

    // 6. normalize this row once: O = O_i / l_i, L = m_i + log l_i
    if (row_valid) {
        const float inv_l = 1.0f / l_i;
        for (int x = 0; x < d; ++x) Oi[tx * ds + x] *= inv_l;
        L[bh * Tq + row] = m_i + logf(l_i);
    }
    __syncthreads();  // rows were normalized by their owners; the store below mixes rows across threads

    // 7. write O_i back to global memory, coalesced like the load
    for (int e = tx; e < Br * d; e += Br) {
        const int r = e / d, c = e % d;
        const int qr = i * Br + r;
        if (qr < Tq) Obh[(long long)qr * d + c] = Oi[r * ds + c];  // tail: rows past Tq are not written
    }
}
