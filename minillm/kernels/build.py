"""Build plumbing for the CUDA kernels: their limits, the g++ emulation build, ctypes, nvcc's report.

What chapter 4 uses but does not teach, in one place:

- the two kernel files (``V1``: flash_attention.cu, the readable one; ``V2``: flash_attention_v2.cu,
  the fast one), each with its entry points, their parameters and status codes (``KernelFile``);
- the kernels' limits (``HS_MAX``, the ``FLASH_*`` / ``FLASH2_*`` status codes, v2's tile sizes and
  head sizes) and the shared memory a block gets without opting in (48 KiB, ``CUDA_EMU_SHARED_BYTES``),
  read from the ``#define`` lines of the .cu files and cuda_emu.h, so each number is written once, in
  the C source that uses it; fused.cu's kernels' parameters, names and types, likewise from their
  ``extern "C"`` lines (``read_entry_points``), the one declaration the launchers and references follow;
- ``build_emulator``: a .cu compiled by g++ against cuda_emu.h into a shared library, cached by the
  hash of its sources, flags and compiler in ``kernel_cache_dir()`` (a user cache folder, never
  inside the installed package); ``load_emulator``: a kernel's launch entry point with ctypes types;
- ``nvcc_resource_report``: registers and spills of each kernel as ptxas reports them.
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
from dataclasses import dataclass
from pathlib import Path

KERNEL_DIR = Path(__file__).parent
KERNEL_SOURCE = KERNEL_DIR / "flash_attention.cu"
V2_SOURCE = KERNEL_DIR / "flash_attention_v2.cu"
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


def status_codes(defines: dict, prefix: str) -> dict[int, str]:
    """A kernel's status #defines PREFIX_* (0 = success) -> {code: "NAME: what it means"}."""
    return {value: f"{name}: {comment}" for name, (value, comment) in defines.items()
            if name.startswith(prefix) and value != 0}


KERNEL_DEFINES = read_defines(KERNEL_SOURCE)
HS_MAX = KERNEL_DEFINES["HS_MAX"][0]  # the largest head size v1 accepts
KERNEL_STATUS = status_codes(KERNEL_DEFINES, "FLASH_")  # v1's FLASH_* codes -> what each one means
V2_DEFINES = read_defines(V2_SOURCE)
V2_THREADS, V2_BR, V2_BC, V2_PAD = (V2_DEFINES[n][0] for n in ("V2_THREADS", "V2_BR", "V2_BC", "V2_PAD"))
# the head sizes v2 is compiled for: its FLASH2_ENTRY(HS) lines, one extern "C" kernel each
V2_HEAD_SIZES = tuple(int(h) for h in re.findall(r"^FLASH2_ENTRY\((\d+)\)", V2_SOURCE.read_text(), re.M))
# shared memory every NVIDIA GPU gives a block without opting in, and what the emulated device offers
DEFAULT_SMEM_BYTES = read_defines(EMU_HEADER)["CUDA_EMU_SHARED_BYTES"][0]
EMULATED_SMEM_OPTIN = 232_448  # what a block may opt in to on an H100/H200 (227 KiB): the emulated GPU's

FLOAT_P, INT_P = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int)
# `extern "C" __global__ void name(const float* x, int C)`: a kernel's entry point, its parameters up to ")"
ENTRY_POINT = re.compile(r'^extern "C" __global__ void (\w+)\(([^)]*)\)', re.M)
C_PARAMETER = re.compile(r"^(?:const\s+)?(float|int)\s*(\*?)\s*(\w+)$")  # `const float* x`, `int C`
C_PARAMETER_TYPES = {("float", "*"): FLOAT_P, ("int", "*"): INT_P, ("float", ""): ctypes.c_float,
                     ("int", ""): ctypes.c_int}


def read_entry_points(path: Path) -> dict[str, dict[str, type]]:
    """The extern "C" kernels of a C source -> {kernel: {parameter name: ctypes type}}, parameters in order: the
    one declaration of each kernel's arguments, which the ctypes launcher, CuPy's call and the references follow.

    Example: ``extern "C" __global__ void bias_gelu(float* h, const float* bias, int H)`` ->
    {"bias_gelu": {"h": FLOAT_P, "bias": FLOAT_P, "H": c_int}}. Raises KernelError on a parameter that is not
    a float, an int or a pointer to one.
    """
    entries = {}
    for name, params in ENTRY_POINT.findall(Path(path).read_text()):
        entries[name] = {}
        for param in params.split(","):
            found = C_PARAMETER.match(" ".join(param.split()))
            if found is None:
                raise KernelError(f"{Path(path).name}: kernel {name}'s parameter {param.strip()!r} is not a float, "
                                  "an int or a pointer to one")
            entries[name][found.group(3)] = C_PARAMETER_TYPES[found.group(1), found.group(2)]
    return entries


@dataclass(frozen=True)
class KernelFile:
    """A .cu file and its extern "C" kernels, which take ``params`` (ctypes types, in order: one tuple that
    every kernel of the file shares, or {kernel name: its tuple}) and report ``status`` codes ({code:
    meaning}) through an int* status argument."""

    source: Path
    names: tuple[str, ...]
    params: tuple | dict
    status: dict

    def signature(self, name: str) -> tuple:
        """The ctypes types of kernel ``name``'s parameters, in order."""
        return self.params[name] if isinstance(self.params, dict) else self.params


# v1: Q, K, V, O, L, status, Tq, Tk, d, Bc, causal, scale
V1 = KernelFile(KERNEL_SOURCE, (KERNEL_NAME,), (FLOAT_P,) * 5 + (INT_P,) + (ctypes.c_int,) * 5 + (ctypes.c_float,),
                KERNEL_STATUS)
# v2: Q, K, V, O, L, status, Tq, Tk, causal, scale (the head size is the kernel's: one kernel per size)
V2 = KernelFile(V2_SOURCE, tuple(f"flash_attention_v2_hs{h}" for h in V2_HEAD_SIZES),
                (FLOAT_P,) * 5 + (INT_P,) + (ctypes.c_int,) * 3 + (ctypes.c_float,),
                status_codes(V2_DEFINES, "FLASH2_"))
# fused.cu: the elementwise and row-wise kernels of a decode step (minillm.fused), each with its own parameters
FUSED_SOURCE = KERNEL_DIR / "fused.cu"
FUSED_DEFINES = read_defines(FUSED_SOURCE)
FUSED_THREADS, FUSED_HS_MAX, NORM_SMEM_FLOATS = (FUSED_DEFINES[n][0] for n in ("FUSED_THREADS", "HS_MAX",
                                                                                  "NORM_SMEM_FLOATS"))
I, F = ctypes.c_int, ctypes.c_float
# each kernel's parameters, read from its `extern "C" __global__ void name(...)` line: {name: {parameter: type}}
FUSED_PARAMS = read_entry_points(FUSED_SOURCE)
FUSED = KernelFile(FUSED_SOURCE, tuple(FUSED_PARAMS), {name: tuple(params.values())
                                                       for name, params in FUSED_PARAMS.items()},
                   status_codes(FUSED_DEFINES, "FUSED_"))
# quant.cu: y = x @ W.T from Q8_0 / Q4_1 blocks (minillm.qcuda); both kernels take W's bytes as int32 words, x, y,
# status, n, m, k
QUANT_SOURCE = KERNEL_DIR / "quant.cu"
QUANT_DEFINES = read_defines(QUANT_SOURCE)
QUANT = KernelFile(QUANT_SOURCE, ("q8_0_product", "q4_1_product"), (INT_P, FLOAT_P, FLOAT_P, INT_P, I, I, I),
                   status_codes(QUANT_DEFINES, "QUANT_"))
KERNELS = {name: kernel for kernel in (V1, V2, FUSED, QUANT) for name in kernel.names}  # kernel name -> its file


def raise_status(code: int, name: str = KERNEL_NAME) -> None:
    """Turn kernel ``name``'s status code into a KernelError naming the violated limit (0: nothing to do)."""
    if code != 0:
        meaning = KERNELS[name].status.get(code, f"unknown status {code}")
        limit = f" (HS_MAX = {HS_MAX})" if name == KERNEL_NAME else ""
        raise KernelError(f"{name} refused the launch: {meaning}{limit}")


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
# and for each kernel one extern "C" entry point launch_<kernel> for ctypes that does what
# <<<grid, block, smem>>> does.
EMU_ENTRY = """\
extern "C" int launch_{name}({params},
    unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned smem, char* err, int errlen) {{
    return cuda_emu::launch(dim3(gx, gy, gz), dim3(bx), smem, sram, err, errlen, {name}, {args});
}}
"""
C_TYPES = {FLOAT_P: "float*", INT_P: "int*", ctypes.c_int: "int", ctypes.c_float: "float"}


def emu_entry(name: str, signature: tuple) -> str:
    """The extern "C" entry point launch_<name> for a kernel whose parameters have these ctypes types."""
    params = ", ".join(f"{C_TYPES[t]} a{n}" for n, t in enumerate(signature))
    return EMU_ENTRY.format(name=name, params=params, args=", ".join(f"a{n}" for n in range(len(signature))))


def emu_launcher(source: Path, kernel: KernelFile) -> str:
    """The launcher translation unit of ``source`` (kernel's file, or a mutant of it)."""
    entries = "".join(emu_entry(name, kernel.signature(name)) for name in kernel.names)
    return f'#include "{source.as_posix()}"\nCUDA_EMU_DYNAMIC_SHARED(float, sram);\n{entries}'

EMU_FLAGS = ["-std=c++20", "-O2", "-shared", "-fPIC", "-pthread"]
SANITIZE_FLAGS = {None: [], "thread": ["-fsanitize=thread", "-g"], "address": ["-fsanitize=address", "-g"]}


def build_emulator(source: Path = KERNEL_SOURCE, sanitize: str | None = None, compiler: str = "g++",
                   shared_bytes: int = DEFAULT_SMEM_BYTES, kernel: KernelFile = V1,
                   race_window_us: int = 0) -> Path:
    """Compile a .cu + cuda_emu.h into a shared library once; later calls return the cached path.

    ``kernel``: the KernelFile whose entry points ``source`` defines (V1, or V2 for flash_attention_v2.cu and
    its mutants).
    ``race_window_us``: a pause every waiting thread takes between arriving at a barrier and checking it
    (``CUDA_EMU_RACE_WINDOW_US``), so a stress test meets, every time, the descheduling that a busy machine
    brings only now and then. 0 (no pause) for every real use.
    ``shared_bytes``: the most dynamic shared memory the emulated device gives a block (48 KiB, what every
    GPU gives without opting in; a GPU's opt-in limit to emulate one). The cache key hashes the kernel
    source, the header, the flags and the compiler (contents, not paths: a copy of the project elsewhere, or a
    mutant identical to a built kernel, reuses the build), so editing the .cu rebuilds it. Raises KernelError
    with g++'s message when the compile fails.
    """
    source = Path(source).resolve()
    cxx = shutil.which(compiler)
    if cxx is None:
        raise KernelError(f"{compiler} not found: emulating the CUDA kernel on a CPU needs a C++20 compiler")
    flags = EMU_FLAGS + SANITIZE_FLAGS[sanitize]
    if shared_bytes != DEFAULT_SMEM_BYTES:
        flags.append(f"-DCUDA_EMU_SHARED_BYTES={shared_bytes}")
    if race_window_us:
        flags.append(f"-DCUDA_EMU_RACE_WINDOW_US={int(race_window_us)}")
    launcher_text = emu_launcher(source, kernel)
    h = hashlib.sha256()
    for part in (source.read_bytes(), EMU_HEADER.read_bytes(), " ".join(flags).encode(), cxx.encode(),
                 emu_launcher(Path(source.name), kernel).encode()):
        h.update(part)
    tag = f"{source.stem}-{sanitize or 'plain'}-{h.hexdigest()[:16]}"
    out_dir = kernel_cache_dir()
    lib = out_dir / f"{tag}.so"
    if lib.exists():
        return lib
    launcher = out_dir / f"{tag}.cpp"
    launcher.write_text(launcher_text)
    tmp = out_dir / f"{tag}.{os.getpid()}.tmp.so"
    command = [cxx, *flags, "-include", str(EMU_HEADER), str(launcher), "-o", str(tmp)]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise KernelError(f"g++ could not build {source.name} against cuda_emu.h:\n{proc.stderr}")
    os.replace(tmp, lib)  # atomic: a concurrent build of the same key writes the same bytes
    return lib


_emulators: dict = {}  # (library path, kernel name) -> its loaded entry point
EMULATOR_LOCK = threading.Lock()  # emulated launches run one at a time (ctypes releases the GIL)
LAUNCH_PARAMS = [ctypes.c_uint] * 5 + [ctypes.c_char_p, ctypes.c_int]  # grid x y z, block x, shared bytes, error


def load_emulator(lib: Path, name: str = KERNEL_NAME):
    """The ``launch_<name>`` entry point of a built library, with its ctypes signature."""
    if (lib, name) not in _emulators:
        fn = getattr(ctypes.CDLL(str(lib)), f"launch_{name}")
        fn.argtypes = list(KERNELS[name].signature(name)) + LAUNCH_PARAMS
        fn.restype = ctypes.c_int
        _emulators[lib, name] = fn
    return _emulators[lib, name]


def run_emulated(lib: Path, args, grid: tuple[int, int, int], block_x: int, smem_bytes: int,
                 name: str = KERNEL_NAME) -> None:
    """Launch kernel ``name`` of a built library: args in its parameters' order (NumPy arrays for the
    pointers, numbers for the rest), grid (x, y, z), block (block_x,), dynamic shared memory in bytes.
    Raises KernelError with the emulator's message when it refuses the launch (a diverged barrier,
    shared memory beyond its device's)."""
    c_args = [a.ctypes.data_as(param) if param in (FLOAT_P, INT_P) else param(a).value
              for a, param in zip(args, KERNELS[name].signature(name))]
    err = ctypes.create_string_buffer(1024)
    with EMULATOR_LOCK:
        rc = load_emulator(lib, name)(*c_args, *grid, block_x, smem_bytes, err, len(err))
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


def parse_ptxas_functions(text: str) -> dict[str, dict]:
    """ptxas's report of a file with several kernels -> {kernel name: parse_ptxas_report(its part)}."""
    parts = re.split(r"Compiling entry function '(\w+)'", text)
    return {name: parse_ptxas_report(body) for name, body in zip(parts[1::2], parts[2::2])}


def nvcc_resource_report(arch: str = "sm_90", source: Path = KERNEL_SOURCE, nvcc: str = "nvcc",
                         extra_flags: tuple[str, ...] = ()) -> dict:
    """Compile a kernel file for one GPU architecture with nvcc (device code only) and read ptxas's report.

    nvcc -arch=<arch> -cubin -Xptxas -v [extra_flags] <source>. Returns the worst case over the file's
    kernels (most registers, stack and spill bytes) as parse_ptxas_report does, plus "functions" (each
    kernel's numbers), "arch" and the raw "report". Spills (registers that did not fit, moved to slow local
    memory) should be 0. Raises KernelError when nvcc is missing or the compile fails.
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
    functions = parse_ptxas_functions(report) or {source.stem: parse_ptxas_report(report)}
    worst = {key: max(f[key] for f in functions.values()) for key in PTXAS_PATTERNS}
    return {"arch": arch, **worst, "functions": functions, "report": report.strip()}
