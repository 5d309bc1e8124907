"""The CUDA kernel of chapter 4 and what it takes to build and run it (with or without a GPU).

    flash_attention.cu   the FlashAttention forward pass as one raw CUDA C kernel
    cuda_emu.h           the header that lets g++ compile and run the same .cu on a CPU
    build.py             its limits (read from the sources), g++/ctypes, nvcc's resource report
    launch.py            tiles and shared memory, NVRTC, flash_attention_cuda, flash_attention_emulated
    mutants.py           the classic kernel bugs as edits of flash_attention.cu, for the checks to catch
"""
