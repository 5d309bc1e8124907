/* small_matmul.c: y = x @ w for a few rows of x, streaming each weight row once, with no packing.
 *
 *     y[n, out] = x[n, in] @ w[in, out]        float32, row-major, w stored [in, out] as in minillm
 *
 * Why: a speculative verification multiplies n = 2..8 token rows by every weight matrix. BLAS sends
 * n = 1 to its matrix-vector product, which streams w once, and n >= 2 to its matrix-matrix product,
 * which first copies w into a blocked layout ("packing") on every call: for a few rows that copy costs
 * more than the arithmetic (docs/verify_cost.md). This kernel reads w where it lies, row after row, like
 * the matrix-vector product does, and multiplies each row into all n token rows while it is in the cache.
 *
 * How: k runs over the rows of w in blocks of KB. For one block, each token row i adds
 *     y[i, :] += x[i, k] w[k, :] + x[i, k+1] w[k+1, :] + ... + x[i, k+KB-1] w[k+KB-1, :]
 * The KB rows of w (KB x out floats: 24 KiB for out = 768) come from memory for i = 0 and from the L1
 * cache for every later row; y (n x out floats) stays in the L1/L2 cache throughout. The innermost loop
 * runs over j with unit stride, so the compiler vectorizes it (gcc -O3 -march=native: AVX2 or AVX-512
 * on x86, NEON on ARM); there are no intrinsics and nothing tuned to one BLAS build.
 *
 * Each y[i, j] is one sum over k = 0..in-1 in order, whatever n is: a token row's result does not
 * depend on the other rows of the call.
 *
 * Reference: x @ w in float64 (tests/test_small_matmul.py).
 */

#define KB 8 /* rows of w per pass over y: KB multiply-adds per load and store of y[i, j] */

/* The entry point (ctypes): x, w and y C-contiguous float32; n, in, out >= 1. */
void small_matmul(const float *restrict x, const float *restrict w, float *restrict y, long n, long in,
                  long out) {
    for (long i = 0; i < n * out; i++)
        y[i] = 0.0f;
    long k0 = 0;
    for (; k0 + KB <= in; k0 += KB) { /* pass 1: full blocks of KB rows of w */
        const float *wk = w + k0 * out; /* row k0 of w; row k0 + kk is wk + kk * out */
        for (long i = 0; i < n; i++) {
            const float *xi = x + i * in + k0; /* x[i, k0 .. k0 + KB] */
            float *yi = y + i * out;
            for (long j = 0; j < out; j++) {
                float sum = yi[j];
                for (int kk = 0; kk < KB; kk++)
                    sum += xi[kk] * wk[kk * out + j];
                yi[j] = sum;
            }
        }
    }
    for (; k0 < in; k0++) /* pass 2: the last in % KB rows of w, one at a time */
        for (long i = 0; i < n; i++)
            for (long j = 0; j < out; j++)
                y[i * out + j] += x[i * in + k0] * w[k0 * out + j];
}
