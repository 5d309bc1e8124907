"""The CUDA kernels of chapter 4 and what it takes to build and run them (with or without a GPU).

    flash_attention.cu     v1: the FlashAttention forward pass as one raw CUDA C kernel, to read
    flash_attention_v2.cu  v2: the same pass with warps, register tiles, shuffles and 128-bit loads, to run
    cuda_emu.h             the header that lets g++ compile and run the same .cu files on a CPU
    build.py               their limits (read from the sources), g++/ctypes, nvcc's resource report
    launch.py              tiles and shared memory, NVRTC, the launchers on a GPU and emulated
    mutants.py             the classic kernel bugs as edits of the .cu files, for the checks to catch
"""
