// quant.cu -- y = x @ W.T with W in GGUF Q8_0 or Q4_1 blocks, read as the file's bytes, float32 sums.
//
//     y[i, j] = sum_t x[i, t] w[j, t]      x (n, k) float32, n = 1..QROWS_MAX token rows,
//                                          W (m, k) in blocks of QK = 32 weights  ->  y (n, m) float32
//
// The reference is x @ W.dequantize().T (minillm/quantize.py holds the formats and their NumPy
// dequantizers; minillm/qcuda.py launches this file and is checked against it). The two blocks are
// llama.cpp's block_q8_0 and block_q4_1, byte for byte:
//
//     Q8_0  34 bytes: fp16 d (bytes 0-1), int8 q[32] (bytes 2..33)                w[j] = d * q[j]
//     Q4_1  20 bytes: fp16 d (0-1), fp16 m (2-3), 16 bytes of nibbles (4..19)      w[j] = d * q[j] + m
//           byte 4 + j holds q[j] in its low nibble and q[j + 16] in its high nibble
//
// A decode step (n = 1) or a short verification (n <= 16) reads every weight once and does n multiply-adds
// with it, so its time is W's bytes over the memory bandwidth: a Q4_1 weight (5 bits) costs about a sixth of
// a float32 one -- as long as it is expanded to float32 only in registers, never in memory.
//
//   kernel          grid                          reason
//   q8_0_product    (ceil(m / QROWS_PER_BLOCK))   y = x @ W.T, W in Q8_0 blocks (8.5 bits per weight)
//   q4_1_product    (ceil(m / QROWS_PER_BLOCK))   y = x @ W.T, W in Q4_1 blocks (5 bits per weight)
//
// Who owns what (lane = threadIdx.x % 32, warp = threadIdx.x / 32):
//   block      QROWS_PER_BLOCK consecutive rows of W (columns of y): QWARPS warps x QROWS_PER_WARP rows
//   warp       its QROWS_PER_WARP rows, one block of 32 weights of each row after the other
//   lane j     weight j of every block: the warp reads a block's quants in one 32-byte (Q8_0) or 16-byte
//              (Q4_1) access, and d (and m) at one address for all lanes (a broadcast). The lane
//              dequantizes its weight once and multiplies it into all n token rows: n sums per row it owns,
//              in registers. At the end the 32 lanes' sums of each (token row, row) meet by __shfl_xor_sync.
//
// Shared memory: a tile of x, n x kt floats (kt = min(QTILE_K, k - k0) columns), copied once by the whole
// block and read by each of its warps for each of their rows. 4 * n * min(QTILE_K, k) bytes: 32 KiB at most,
// under the 48 KiB every GPU gives a block without opting in, for any k.
//
// W arrives as int32 words that hold its bytes (zero-padded to a whole word): the pointer type every
// launcher of this project passes. The kernel reads them as bytes, in the file's order.
//
// A launch it cannot take (n outside 1..QROWS_MAX, k not a positive multiple of 32) writes its QUANT_* code
// to *status and returns; minillm/qcuda.py refuses both before launching and turns a code into an error.
//
// Launch (minillm/qcuda.py): grid (ceil(m / QROWS_PER_BLOCK),), block (QTHREADS,), dynamic shared memory
// 4 * n * min(QTILE_K, k) bytes. The same file builds three ways, unchanged:
//   NVRTC (cupy.RawKernel)                           on a GPU
//   nvcc -arch=sm_90 -cubin -Xptxas -v quant.cu      registers and spills (build.nvcc_resource_report)
//   g++ -std=c++20 -O2 -include cuda_emu.h           on a CPU, each block's threads as real threads (tests)
//
// Honest verdict: a teaching kernel. Scalar float32 FMAs and byte loads, no dp4a or tensor cores, no
// vector loads; python -m minillm.tools.gpu_check times it against cuBLAS on the dequantized weight.

#define QK 32               // weights per block
#define QROWS_MAX 16        // most token rows of x: each lane keeps QROWS_MAX sums per row of W in registers
#define QWARPS 4            // warps per block
#define QROWS_PER_WARP 2    // rows of W each warp owns
#define QROWS_PER_BLOCK 8   // QWARPS * QROWS_PER_WARP
#define QTHREADS 128        // threads per block: QWARPS warps of 32
#define QTILE_K 512         // columns of x staged in shared memory at a time (16 blocks)

// status codes written to *status (0 = success); the launcher turns them into exceptions
#define QUANT_OK 0
#define QUANT_BAD_ROWS 1  // n (token rows of x) outside 1..QROWS_MAX
#define QUANT_BAD_K 2     // k (inputs per row) not a positive multiple of 32

#define FULL_MASK 0xffffffffu  // every lane of the warp takes part in a shuffle

static_assert(QTHREADS == QWARPS * 32 && QROWS_PER_BLOCK == QWARPS * QROWS_PER_WARP, "the block's shape");
static_assert(QTILE_K % QK == 0, "a tile holds whole blocks");

// fp16 bits -> float: a sign, a 5-bit exponent (bias 15) and a 10-bit mantissa, as GGUF stores d and m.
// Examples: 0x3C00 -> 1.0, 0xC000 -> -2.0, 0x2E66 -> 0.0999755859375, 0x0001 -> 2^-24 (the smallest subnormal).
__device__ __forceinline__ float fp16_to_float(unsigned int h) {
    const unsigned int sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
        const float v = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (exponent == 0x1fu) return __int_as_float((int)(sign | 0x7f800000u | (mantissa << 13)));  // inf, NaN
    return __int_as_float((int)(sign | ((exponent + 112u) << 23) | (mantissa << 13)));  // rebias 15 -> 127
}

// the little-endian fp16 at byte p
__device__ __forceinline__ float fp16_at(const unsigned char* p) { return fp16_to_float(p[0] | (p[1] << 8)); }

// Each block format: its size and weight j of the block at `blk` (lane j asks for weight j).
struct BlockQ8_0 {  // llama.cpp's block_q8_0 { half d; int8_t qs[32]; }
    static constexpr int BYTES = 34;
    __device__ static float weight(const unsigned char* blk, int j) {
        const float d = fp16_at(blk);  // this block's scale
        return d * (float)(signed char)blk[2 + j];
    }
};

struct BlockQ4_1 {  // llama.cpp's block_q4_1 { half d; half m; uint8_t qs[16]; }
    static constexpr int BYTES = 20;
    __device__ static float weight(const unsigned char* blk, int j) {
        const float d = fp16_at(blk), m = fp16_at(blk + 2);
        const unsigned int byte = blk[4 + j % 16];
        const unsigned int q = j < 16 ? (byte & 0x0fu) : (byte >> 4);  // j: low nibble, j + 16: high
        return d * (float)q + m;
    }
};

template <typename Block>
__device__ void quant_product(const int* W_words, const float* x, float* y, int* status, int n, int m, int k) {
    extern __shared__ float sram[];  // x's tile: n rows of kt floats
    if (n < 1 || n > QROWS_MAX || k < QK || k % QK != 0) {  // the same for every thread: no divergence
        if (threadIdx.x == 0) *status = (n < 1 || n > QROWS_MAX) ? QUANT_BAD_ROWS : QUANT_BAD_K;
        return;
    }
    const unsigned char* W = reinterpret_cast<const unsigned char*>(W_words);  // the blocks, as in the file
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int row0 = blockIdx.x * QROWS_PER_BLOCK + warp * QROWS_PER_WARP;  // this warp's first row of W
    const long long row_bytes = (long long)(k / QK) * Block::BYTES;
    float acc[QROWS_PER_WARP][QROWS_MAX];  // acc[r][i]: this lane's part of y[i, row0 + r]
#pragma unroll
    for (int r = 0; r < QROWS_PER_WARP; ++r)
#pragma unroll
        for (int i = 0; i < QROWS_MAX; ++i) acc[r][i] = 0.0f;

    for (int k0 = 0; k0 < k; k0 += QTILE_K) {
        const int kt = min(QTILE_K, k - k0);  // a multiple of 32, as k is
        // pass 1: the whole block copies x[:, k0 : k0 + kt] into shared memory, sram[i * kt + c] = x[i, k0 + c]
        for (int e = threadIdx.x; e < n * kt; e += QTHREADS) sram[e] = x[(long long)(e / kt) * k + k0 + e % kt];
        __syncthreads();  // the tile is complete before any warp reads it: each warp reads what all threads copied

        // pass 2: block after block of the warp's rows; lane j dequantizes weight j once, for all n token rows
        for (int c = 0; c < kt; c += QK) {
            float xc[QROWS_MAX];  // x[i, k0 + c + lane], the input this lane's weights multiply, per token row
#pragma unroll
            for (int i = 0; i < QROWS_MAX; ++i) xc[i] = i < n ? sram[i * kt + c + lane] : 0.0f;
            const long long block_offset = (long long)((k0 + c) / QK) * Block::BYTES;  // block b of its row
#pragma unroll
            for (int r = 0; r < QROWS_PER_WARP; ++r) {
                if (row0 + r >= m) break;  // rows past m (the last block's): the same for the whole warp
                const float w = Block::weight(W + (row0 + r) * row_bytes + block_offset, lane);
#pragma unroll
                for (int i = 0; i < QROWS_MAX; ++i)
                    if (i < n) acc[r][i] += w * xc[i];
            }
        }
        __syncthreads();  // every warp is done reading the tile before the next pass 1 overwrites it
    }

    // pass 3: each sum over the warp's 32 lanes, 5 butterfly steps (every lane ends with the total); lane 0 stores
#pragma unroll
    for (int r = 0; r < QROWS_PER_WARP; ++r) {
        if (row0 + r >= m) break;
#pragma unroll
        for (int i = 0; i < QROWS_MAX; ++i) {
            if (i >= n) break;  // n is the same for every lane: all 32 take part in each shuffle
            float s = acc[r][i];
            for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(FULL_MASK, s, offset);
            if (lane == 0) y[(long long)i * m + row0 + r] = s;
        }
    }
}

extern "C" __global__ void __launch_bounds__(QTHREADS) q8_0_product(const int* W_words, const float* x, float* y,
                                                                    int* status, int n, int m, int k) {
    quant_product<BlockQ8_0>(W_words, x, y, status, n, m, k);
}

extern "C" __global__ void __launch_bounds__(QTHREADS) q4_1_product(const int* W_words, const float* x, float* y,
                                                                    int* status, int n, int m, int k) {
    quant_product<BlockQ4_1>(W_words, x, y, status, n, m, k);
}
