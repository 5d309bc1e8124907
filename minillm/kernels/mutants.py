"""Broken kernels on purpose: the classic CUDA mistakes, each an edit of the real flash_attention.cu
(KERNEL_MUTANTS), flash_attention_v2.cu (V2_MUTANTS), fused.cu (FUSED_MUTANTS) or quant.cu (QUANT_MUTANTS).

Chapter 4 shows that its checks bite by running them on these, and tests/test_flash_attention.py
asserts that every one is caught. Each mutant is the current kernel with one or two textual edits,
made when it is written (a stale full copy could drift from the kernel); an edit whose ``old`` text
does not occur exactly once in the kernel is refused, so a rewritten kernel says which mutant to update.

    path = write_kernel_mutant("no_tail_check", build.KERNEL_SOURCE, folder)
    launch.flash_attention_emulated(q, k, v, source=path)   # NaN in the output when N % 32 != 0
"""

from pathlib import Path

# name -> [(old, new), ...]: the edits of minillm/kernels/flash_attention.cu that make the mutant
KERNEL_MUTANTS = {
    # the __syncthreads() at the end of the key-tile loop is removed: a fast thread overwrites
    # K_j, V_j with the next tile while slower threads still read them. Caught by ThreadSanitizer.
    "missing_sync": [(
        "        __syncthreads();  // every thread is done with K_j, V_j before the next iteration overwrites them\n",
        "        // (mutant: the __syncthreads() that protected K_j, V_j from being overwritten is gone)\n",
    )],
    # the tail bounds check of the K/V tile load is removed: rows past Tk are read. Caught by the
    # output check on N not a multiple of the tile (the emulator poisons memory past each buffer).
    "no_tail_check": [(
        "            const bool in_bounds = kr < Tk;  // tail: key rows past Tk read nothing\n",
        "            const bool in_bounds = true;  // (mutant: no tail bounds check)\n            (void)kr;\n",
    )],
    # the running sum and output are not rescaled when the running max grows. Caught by the
    # output check.
    "no_rescale": [
        ("            l_i = alpha * l_i + l_tile;\n",
         "            l_i = l_i + l_tile;  // (mutant)\n            (void)alpha;\n"),
        ("                Oi[tx * ds + x] = alpha * Oi[tx * ds + x] + pv;\n",
         "                Oi[tx * ds + x] = Oi[tx * ds + x] + pv;  // (mutant: no rescaling)\n"),
    ],
    # the barrier after the normalization moves inside `if (row_valid)`: only some threads reach it
    # when Tq is not a multiple of Br. Caught by the emulator's divergence check (KernelError).
    "divergent_sync": [
        ("        L[bh * Tq + row] = m_i + logf(l_i);\n    }\n"
         "    __syncthreads();  // rows were normalized by their owners; the store below mixes rows across threads\n",
         "        L[bh * Tq + row] = m_i + logf(l_i);\n"
         "        __syncthreads();  // (mutant: a barrier inside a branch that only some threads take)\n    }\n"),
    ],
}


# name -> [(old, new), ...]: the edits of minillm/kernels/flash_attention_v2.cu that make the mutant
V2_MUTANTS = {
    # each lane keeps the max of its own 8 scores instead of the row's: the 8 lanes of a row scale
    # their parts of P by different exponentials. Caught by the output check.
    "v2_no_row_max": [(
        "            const float m_new = fmaxf(m[a], row_max(m_tile));\n",
        "            const float m_new = fmaxf(m[a], m_tile);  // (mutant: no shuffle across the row's lanes)\n",
    )],
    # the __syncwarp() between writing P and reading it is removed: a lane may read an entry of P that
    # another lane of its warp has not written yet (lanes of a warp are not in lock step since Volta).
    # Caught by ThreadSanitizer.
    "v2_missing_syncwarp": [(
        "        __syncwarp();  // the warp's P rows are complete before its lanes read each other's entries\n",
        "        // (mutant: no __syncwarp() between writing P and reading it)\n",
    )],
    # the tail bounds check of the K/V tile load is removed: key rows past Tk are read. Caught by the
    # output check (the emulator poisons memory past each buffer).
    "v2_no_tail_check": [(
        "            const bool in_bounds = kr < Tk;\n",
        "            const bool in_bounds = true;  // (mutant: no tail bounds check)\n",
    )],
    # the final row-sum shuffle moves inside `if (row < Tq)`: lanes whose rows lie past Tq skip it while
    # the rest of their warp waits. Caught by the emulator's divergence check (KernelError).
    "v2_shuffle_in_branch": [
        ("        const float l_row = row_sum(l[a]);  // every lane calls the shuffle, also for rows past Tq\n", ""),
        ("        if (row < Tq) {\n            const float inv_l",
         "        if (row < Tq) {\n            const float l_row = row_sum(l[a]);  // (mutant: a shuffle in a branch)\n"
         "            const float inv_l"),
    ],
}


# name -> [(old, new), ...]: the edits of minillm/kernels/fused.cu (the launch floor's fused kernels)
FUSED_MUTANTS = {
    # the loop over the cache stops before the query's own position: a token does not see itself.
    # Caught by the output check (every T, every position).
    "attention_off_by_one": [(
        "    for (int j = lane; j <= p; j += FUSED_THREADS) {\n",
        "    for (int j = lane; j < p; j += FUSED_THREADS) {  // (mutant: stops before the query's own key)\n",
    )],
    # the running sum and output are not rescaled when a lane's running max grows: exp(s - m_new) mixes
    # scales. Caught by the output check on scores that grow along the sequence.
    "attention_no_rescale": [
        ("        l = alpha * l + e;\n", "        l = l + e;  // (mutant: no rescaling)\n"),
        ("        for (int d = 0; d < hs; ++d) acc[d] = alpha * acc[d] + e * V[(long long)j * hs + d];\n",
         "        for (int d = 0; d < hs; ++d) acc[d] = acc[d] + e * V[(long long)j * hs + d];  // (mutant)\n"),
    ],
    # grouped-query attention maps query head h to KV head h % n_kv (round robin) instead of h / (nh / n_kv)
    # (consecutive query heads share one KV head). Caught by the output check with n_kv < nh.
    "gqa_round_robin": [(
        "    const int kv_head = head / (nh / nkv);\n",
        "    const int kv_head = head % nkv;  // (mutant: round robin)\n",
    )],
    # LayerNorm's variance is taken around 0, not around the mean (RMSNorm's formula in LayerNorm). Caught by
    # the output check on rows whose mean is far from 0.
    "norm_uncentered_variance": [(
        "        const float d = xr[c] - mean;\n",
        "        const float d = xr[c];  // (mutant: the variance ignores the mean)\n",
    )],
    # epsilon added outside the square root. Caught by the output check on rows of tiny values.
    "norm_eps_outside_sqrt": [(
        "    const float inv_std = 1.0f / sqrtf(block_sum(s, sram + FUSED_THREADS) / C + eps);\n",
        "    const float inv_std = 1.0f / (sqrtf(block_sum(s, sram + FUSED_THREADS) / C) + eps);  // (mutant)\n",
    )],
    # RoPE pairs neighbouring dims (2j, 2j + 1: GPT-J's interleaved layout) instead of j and j + hs/2 (the
    # rotate-half layout SmolLM2's weights are in). Caught by the output check.
    "rope_interleaved_pairs": [(
        "            const int j = d % half, partner = d < half ? c + half : c - half;\n",
        "            const int j = d % half, partner = c ^ 1;  // (mutant: interleaved pairs)\n",
    )],
    # the RoPE angle in float, not double: at position 5,000 it is off by about 3e-4 rad. Caught by the output
    # check at large positions.
    "rope_float_angle": [(
        "            const double angle = (double)p * pow((double)theta, -2.0 * j / hs);\n",
        "            const float angle = (float)p * powf(theta, -2.0f * j / hs);  // (mutant: float32 angle)\n",
    )],
}


# name -> [(old, new), ...]: the edits of minillm/kernels/quant.cu (products from Q8_0 / Q4_1 blocks). Each is caught by
# tests/test_qcuda.py: the first three by the output check, the last by the emulator's barrier check (KernelError).
QUANT_MUTANTS = {
    # Q4_1's nibbles read the wrong way round: the high nibble taken for weight j, the low one for weight j + 16.
    "q4_1_nibbles_swapped": [(
        "        const unsigned int q = j < 16 ? (byte & 0x0fu) : (byte >> 4);  // j: low nibble, j + 16: high\n",
        "        const unsigned int q = j < 16 ? (byte >> 4) : (byte & 0x0fu);  // (mutant: high nibble = weight j)\n",
    )],
    # Q8_0's scale read from the next block (b + 1): every weight is scaled by its neighbour's d.
    "q8_0_next_block_scale": [(
        "        const float d = fp16_at(blk);  // this block's scale\n",
        "        const float d = fp16_at(blk + BYTES);  // (mutant: the scale of block b + 1)\n",
    )],
    # Q4_1's minimum dropped: w = d * q instead of d * q + m.
    "q4_1_no_min": [(
        "        return d * (float)q + m;\n",
        "        (void)m;\n        return d * (float)q;  // (mutant: the minimum dropped)\n",
    )],
    # a warp whose rows all lie past m leaves before the barriers: the rest of its block waits at __syncthreads()
    # for threads that are gone (and on a GPU, its share of x's tile is never copied).
    "warp_leaves_early": [(
        "    const int row0 = blockIdx.x * QROWS_PER_BLOCK + warp * QROWS_PER_WARP;  // this warp's first row of W\n",
        "    const int row0 = blockIdx.x * QROWS_PER_BLOCK + warp * QROWS_PER_WARP;  // this warp's first row of W\n"
        "    if (row0 >= m) return;  // (mutant: a warp with no rows leaves before the barriers)\n",
    )],
}


def mutate_kernel(name: str, source: str, mutants: dict = KERNEL_MUTANTS) -> str:
    """The kernel text ``source`` with the edits of mutants[name]; ValueError for an unknown
    name or an edit whose text does not occur exactly once."""
    if name not in mutants:
        raise ValueError(f"unknown kernel mutant {name!r}; known: {', '.join(mutants)}")
    for old, new in mutants[name]:
        count = source.count(old)
        if count != 1:
            raise ValueError(f"kernel mutant {name!r}: the text to replace occurs {count} times, not once")
        source = source.replace(old, new)
    return source


def write_kernel_mutant(name: str, kernel_path, out_dir, mutants: dict = KERNEL_MUTANTS) -> Path:
    """Write the kernel at ``kernel_path`` with mutants[name]'s edits to out_dir/<kernel file>_<name>.cu -> that
    path."""
    text = mutate_kernel(name, Path(kernel_path).read_text(), mutants)
    path = Path(out_dir) / f"{Path(kernel_path).stem}_{name}.cu"
    path.write_text(text)
    return path
