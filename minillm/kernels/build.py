"""Build plumbing for the CUDA kernel: its limits, the g++ emulation build, ctypes, nvcc's report.

What chapter 4 uses but does not teach, in one place:

- the kernel's limits (``HS_MAX``, its ``FLASH_*`` status codes) and the shared memory a block gets
  without opting in (48 KiB, ``CUDA_EMU_SHARED_BYTES``), read from the ``#define`` lines of
  flash_attention.cu and cuda_emu.h, so each number is written once, in the C source that uses it;
- ``build_emulator``: the .cu compiled by g++ against cuda_emu.h into a shared library, cached by the
  hash of its sources, flags and compiler in ``kernel_cache_dir()`` (a user cache folder, never
  inside the installed package); ``load_emulator``: its launch entry point with ctypes types;
- ``nvcc_resource_report``: registers and spills as ptxas reports them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

KERNEL_DIR = Path(__file__).parent
KERNEL_SOURCE = KERNEL_DIR / "flash_attention.cu"
EMU_HEADER = KERNEL_DIR / "cuda_emu.h"
KERNEL_NAME = "flash_attention_forward"
CACHE_ENV = "MINILLM_KERNEL_CACHE"  # overrides where built kernels are cached

# `#define NAME 128  // comment` or `#define NAME (48 * 1024)`: integer constants of a C source
DEFINE = re.compile(r"^\s*#define\s+(\w+)\s+\(?\s*(\d+(?:\s*\*\s*\d+)*)\s*\)?\s*(?://\s*(.*))?$")


class KernelError(RuntimeError):
    """A kernel launch failed: a limit the kernel checks, a compile error, a diverged barrier."""


def read_defines(path: Path) -> dict[str, tuple[int, str]]:
    """The integer ``#define`` lines of a C source -> {NAME: (value, comment)}.

    Example: ``#define HS_MAX 128  // largest head size`` -> {"HS_MAX": (128, "largest head size")};
    ``#define CUDA_EMU_SHARED_BYTES (48 * 1024)`` -> {"CUDA_EMU_SHARED_BYTES": (49152, "")}.
    """
    defines = {}
    for line in Path(path).read_text().splitlines():
        found = DEFINE.match(line)
        if found:
            value = 1
            for factor in found.group(2).split("*"):
                value *= int(factor)
            defines[found.group(1)] = (value, (found.group(3) or "").strip())
    return defines


KERNEL_DEFINES = read_defines(KERNEL_SOURCE)
HS_MAX = KERNEL_DEFINES["HS_MAX"][0]  # the largest head size the kernel accepts
KERNEL_STATUS = {  # the kernel's FLASH_* codes (0 = FLASH_OK) -> what each one means
    value: f"{name}: {comment}" for name, (value, comment) in KERNEL_DEFINES.items()
    if name.startswith("FLASH_") and value != 0
}
# shared memory every NVIDIA GPU gives a block without opting in, and what the emulated device offers
DEFAULT_SMEM_BYTES = read_defines(EMU_HEADER)["CUDA_EMU_SHARED_BYTES"][0]


def raise_status(code: int) -> None:
    """Turn the kernel's status code into a KernelError naming the violated limit (0: nothing to do)."""
    if code != 0:
        meaning = KERNEL_STATUS.get(code, f"unknown status {code}")
        raise KernelError(f"{KERNEL_NAME} refused the launch: {meaning} (HS_MAX = {HS_MAX})")


# --- where builds are cached ------------------------------------------------------------------------


def kernel_cache_dir() -> Path:
    """Where built kernels are cached: $MINILLM_KERNEL_CACHE, else $XDG_CACHE_HOME/minillm/kernels
    (default ~/.cache/minillm/kernels); a temporary folder when that is not writable. Never the package."""
    env = os.environ.get(CACHE_ENV)
    if env:
        preferred = Path(env)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        preferred = Path(xdg) / "minillm" / "kernels"
    for folder in (preferred, Path(tempfile.gettempdir()) / "minillm_kernels"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK):
            return folder
    raise KernelError(f"no writable folder to cache built kernels in: set {CACHE_ENV}")


# --- on a CPU: g++ against cuda_emu.h, loaded with ctypes ---------------------------------------------

# The launcher translation unit: the .cu unchanged, the storage for `extern __shared__ float sram[]`,
# and one extern "C" entry point for ctypes that does what <<<grid, block, smem>>> does.
EMU_LAUNCHER = """\
#include "{source}"
CUDA_EMU_DYNAMIC_SHARED(float, sram);
extern "C" int launch_flash_attention_forward(
    const float* Q, const float* K, const float* V, float* O, float* L, int* status,
    int Tq, int Tk, int d, int Bc, int causal, float scale,
    unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned smem, char* err, int errlen) {{
    return cuda_emu::launch(dim3(gx, gy, gz), dim3(bx), smem, sram, err, errlen, flash_attention_forward,
                            Q, K, V, O, L, status, Tq, Tk, d, Bc, causal, scale);
}}
"""
EMU_FLAGS = ["-std=c++20", "-O2", "-shared", "-fPIC", "-pthread"]
SANITIZE_FLAGS = {None: [], "thread": ["-fsanitize=thread", "-g"], "address": ["-fsanitize=address", "-g"]}


def build_emulator(source: Path = KERNEL_SOURCE, sanitize: str | None = None, compiler: str = "g++",
                   shared_bytes: int = DEFAULT_SMEM_BYTES) -> Path:
    """Compile a .cu + cuda_emu.h into a shared library once; later calls return the cached path.

    ``shared_bytes``: the most dynamic shared memory the emulated device gives a block (48 KiB, what every
    GPU gives without opting in; a GPU's opt-in limit to emulate one). The cache key hashes the kernel
    source, the header, the flags and the compiler, so editing the .cu rebuilds it. Raises KernelError
    with g++'s message when the compile fails.
    """
    source = Path(source).resolve()
    cxx = shutil.which(compiler)
    if cxx is None:
        raise KernelError(f"{compiler} not found: emulating the CUDA kernel on a CPU needs a C++20 compiler")
    flags = EMU_FLAGS + SANITIZE_FLAGS[sanitize] + ["-include", str(EMU_HEADER)]
    if shared_bytes != DEFAULT_SMEM_BYTES:
        flags.append(f"-DCUDA_EMU_SHARED_BYTES={shared_bytes}")
    h = hashlib.sha256()
    for part in (source.read_bytes(), EMU_HEADER.read_bytes(), " ".join(flags).encode(), cxx.encode()):
        h.update(part)
    tag = f"{source.stem}-{sanitize or 'plain'}-{h.hexdigest()[:16]}"
    out_dir = kernel_cache_dir()
    lib = out_dir / f"{tag}.so"
    if lib.exists():
        return lib
    launcher = out_dir / f"{tag}.cpp"
    launcher.write_text(EMU_LAUNCHER.format(source=source.as_posix()))
    tmp = out_dir / f"{tag}.{os.getpid()}.tmp.so"
    proc = subprocess.run([cxx, *flags, str(launcher), "-o", str(tmp)], capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise KernelError(f"g++ could not build {source.name} against cuda_emu.h:\n{proc.stderr}")
    os.replace(tmp, lib)  # atomic: a concurrent build of the same key writes the same bytes
    return lib


_emulators: dict = {}  # library path -> its loaded entry point
EMULATOR_LOCK = threading.Lock()  # emulated launches run one at a time (ctypes releases the GIL)
FLOAT_P, INT_P = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int)
# the kernel's parameters in order: Q, K, V, O, L, status, Tq, Tk, d, Bc, causal, scale
KERNEL_PARAMS = [FLOAT_P] * 5 + [INT_P] + [ctypes.c_int] * 5 + [ctypes.c_float]
LAUNCH_PARAMS = [ctypes.c_uint] * 5 + [ctypes.c_char_p, ctypes.c_int]  # grid x y z, block x, shared bytes, error


def load_emulator(lib: Path):
    """The ``launch_flash_attention_forward`` entry point of a built library, with its ctypes signature."""
    if lib not in _emulators:
        fn = ctypes.CDLL(str(lib)).launch_flash_attention_forward
        fn.argtypes = KERNEL_PARAMS + LAUNCH_PARAMS
        fn.restype = ctypes.c_int
        _emulators[lib] = fn
    return _emulators[lib]


def run_emulated(lib: Path, args, grid: tuple[int, int, int], block_x: int, smem_bytes: int) -> None:
    """Launch the built kernel: args in KERNEL_PARAMS order (NumPy arrays for the pointers, numbers for the
    rest), grid (x, y, z), block (block_x,), dynamic shared memory in bytes. Raises KernelError with the
    emulator's message when it refuses the launch (a diverged barrier, shared memory beyond its device's)."""
    c_args = [a.ctypes.data_as(param) if param in (FLOAT_P, INT_P) else param(a).value
              for a, param in zip(args, KERNEL_PARAMS)]
    err = ctypes.create_string_buffer(1024)
    with EMULATOR_LOCK:
        rc = load_emulator(lib)(*c_args, *grid, block_x, smem_bytes, err, len(err))
    if rc != 0:
        raise KernelError(err.value.decode())


# --- what the compiler made of it: nvcc's resource report ---------------------------------------------

PTXAS_PATTERNS = {
    "registers": r"Used (\d+) registers",
    "stack_frame": r"(\d+) bytes stack frame",
    "spill_stores": r"(\d+) bytes spill stores",
    "spill_loads": r"(\d+) bytes spill loads",
}


def parse_ptxas_report(text: str) -> dict:
    """The numbers in `nvcc -Xptxas -v` output -> {registers, stack_frame, spill_stores, spill_loads}.

    Example: "0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads ... Used 255 registers"
    -> {"registers": 255, "stack_frame": 0, "spill_stores": 8, "spill_loads": 8}. Raises ValueError
    when a number is missing (an unexpected report must not pass as "no spills").
    """
    out = {}
    for key, pattern in PTXAS_PATTERNS.items():
        found = re.search(pattern, text)
        if found is None:
            raise ValueError(f"no '{key}' in the ptxas report:\n{text}")
        out[key] = int(found.group(1))
    return out


def nvcc_resource_report(arch: str = "sm_90", source: Path = KERNEL_SOURCE, nvcc: str = "nvcc",
                         extra_flags: tuple[str, ...] = ()) -> dict:
    """Compile the kernel for one GPU architecture with nvcc (device code only) and read ptxas's report.

    nvcc -arch=<arch> -cubin -Xptxas -v [extra_flags] <source>. Returns parse_ptxas_report(...) plus
    "arch" and the raw "report". Spills (registers that did not fit, moved to slow local memory) should be 0.
    Raises KernelError when nvcc is missing or the compile fails.
    """
    exe = shutil.which(nvcc)
    if exe is None:
        raise KernelError(f"{nvcc} not found: install the CUDA toolkit to see the resource report")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = str(Path(tmp) / "k.cubin")
        cmd = [exe, f"-arch={arch}", "-cubin", "-Xptxas", "-v", *extra_flags, str(source), "-o", cubin]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise KernelError(f"nvcc could not compile {Path(source).name} for {arch}:\n{proc.stderr}")
    report = proc.stdout + proc.stderr
    return {"arch": arch, **parse_ptxas_report(report), "report": report.strip()}
