"""The CPU numba compiles minillm's kernels for: its instruction sets, and full-width vectors on AVX-512.

numba makes its code generator once per process, when the first numba function is defined, for the host
CPU's name and features as LLVM reports them. For Intel's CPUs with AVX-512 (Skylake-X to Sapphire Rapids)
LLVM's tuning carries "prefer-256-bit": its vectorizers then use the 256-bit ymm registers although the
512-bit zmm ones are there. minillm's quantized kernels are laid out for one 16-lane zmm per panel row and
32 vector registers (``qkernels.kernel_shape``); compiled at 256 bits every row of a panel takes two ymm,
each weight is converted and multiplied in two halves, and the 16-row kernels spill. ``full_width`` adds
"-prefer-256-bit" to the features numba compiles for, once, before any of minillm's numba functions exists:
``qkernels`` and ``streaming`` call it before they define theirs. docs/quantization.md ("An Intel Xeon")
has the measurement that made it the default.

Two cases keep LLVM's choice: the user's own ``NUMBA_CPU_FEATURES`` (it wins, as numba documents, and
``host_features`` reads it: features turned off there, AVX-512's for instance, are off for the kernels too), and a
process in which other code defined a numba function before minillm was imported (the code generator
already exists). ``tests/test_qkernels.py`` reads the kernels' machine code for the width they got.
"""

from __future__ import annotations

import functools
import os

PREFER_256 = "prefer-256-bit"  # LLVM's tuning feature: vectorize at 256 bits on a CPU with 512-bit registers


@functools.cache
def host_features() -> frozenset:
    """The instruction-set extensions numba compiles for, as LLVM names them ({"avx2", "fma", "avx512f", ...}): this
    CPU's, or those the user's ``NUMBA_CPU_FEATURES`` turns on ("+avx2,...,-avx512f,..." compiles for AVX2 on an
    AVX-512 CPU, and the kernels are then laid out for AVX2's 16 ymm registers)."""
    import llvmlite.binding as llvm

    features = os.environ.get("NUMBA_CPU_FEATURES") or llvm.get_host_cpu_features().flatten()
    return frozenset(f[1:] for f in features.split(",") if f.startswith("+"))


def host_vector() -> tuple[int, int]:
    """(float32 lanes of one vector register, vector registers) on this CPU: (16, 32) with AVX-512 (zmm),
    (8, 16) with AVX2 (ymm)."""
    return (16, 32) if "avx512f" in host_features() else (8, 16)


@functools.cache
def full_width() -> bool:
    """Ask numba for 512-bit vectors on an AVX-512 CPU (LLVM's "-prefer-256-bit"), once per process, before
    its code generator exists. True when numba will compile with it; False on a CPU without AVX-512, when
    ``NUMBA_CPU_FEATURES`` is the user's, or when numba's code generator was made before this call."""
    import numba
    from numba.core import codegen, registry

    if "avx512f" not in host_features() or os.environ.get("NUMBA_CPU_FEATURES"):
        return False
    if "_toplevel_target_context" in vars(registry.cpu_target):  # made already: its features are fixed
        return f"-{PREFER_256}" in (numba.config.CPU_FEATURES or "")
    numba.config.CPU_FEATURES = f"{codegen.get_host_cpu_features()},-{PREFER_256}"
    return True
