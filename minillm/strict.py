"""The strict CuPy stand-in (``MINILLM_BACKEND=strict``): NumPy underneath, CuPy's rules on top.

Code that passes its tests on NumPy can still break on a GPU, where arrays live in device memory and
CuPy refuses to move them silently. This module is a small ``cupy`` made of NumPy, so such code breaks
on a CPU first:

- arrays are ``ndarray``, a device type of its own wrapping a NumPy array; ``xp.asarray`` / ``xp.array``
  are the only way up (host -> device), ``.get()`` / ``xp.asnumpy`` the only way down;
- ``np.asarray(a)`` raises TypeError, as does any operation mixing a device array with a NumPy array
  (``a + host``, ``np.add(host, a)``, ``xp.exp(host)``, ``a[...] = host``); NumPy functions given only
  device arrays dispatch to this module, as CuPy's ``__array_ufunc__``/``__array_function__`` do;
- ``int(a)``, ``float(a)``, ``bool(a)``, ``.item()``, ``.tolist()``, ``.get()``, ``xp.asnumpy`` and
  ``stream.synchronize()`` are allowed and each counts as a **synchronization** (the host waits for
  the device); every operation that writes a new device array counts as a **kernel** launch (views
  such as reshape, transpose and slices launch none), like CuPy's reductions, which return 0-d arrays;
- ``RawKernel`` runs kernels/flash_attention.cu through the chapter-4 emulation (g++ and cuda_emu.h)
  after CuPy's launch rules: arrays must be device arrays of the parameter's type and C-contiguous,
  scalars NumPy scalars of the parameter's exact type (CuPy passes a Python int as a 64-bit integer and
  a Python float as a double, which a kernel's ``int``/``float`` parameter silently misreads), and
  more than 48 KiB of dynamic shared memory needs the opt-in ``max_dynamic_shared_size_bytes``.

``COUNTS`` holds the running totals (kernels, syncs, attribute queries, host-to-device copies).
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import operator
from collections import Counter

import numpy

from .kernels.build import (
    DEFAULT_SMEM_BYTES,
    EMULATED_SMEM_OPTIN,
    KERNELS,
    build_emulator,
    kernel_cache_dir,
    run_emulated,
)

__version__ = "strict stand-in (NumPy " + numpy.__version__ + ")"
COUNTS: Counter = Counter()  # kernels, syncs, attribute_queries, copies_to_device
IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. "
            "Please use `.get()` to construct a NumPy array explicitly.")  # CuPy's own message


def reset_counts() -> None:
    COUNTS.clear()


# ---- moving between the host and the device -----------------------------------------------------------


def unwrap(x, found: list):
    """A device operation's argument -> what NumPy computes with: the NumPy array inside a device array
    (appended to found), containers element by element, numbers and everything else unchanged. A NumPy
    array raises TypeError, as in CuPy."""
    if type(x) is ndarray:
        found.append(x._a)
        return x._a
    if isinstance(x, numpy.ndarray):
        raise TypeError(f"Unsupported type {type(x)}: a NumPy array given to a device operation "
                        "(copy it with xp.asarray first)")
    if isinstance(x, (list, tuple)):
        return type(x)([unwrap(e, found) for e in x])
    return x


def wrap(result, inputs: list):
    """NumPy's result -> device arrays (a NumPy scalar becomes a 0-d array, as CuPy returns); counts one
    kernel for each new array, none for a view of an input."""
    if type(result) is numpy.ndarray:
        if result.base is None or not builtins.any(numpy.may_share_memory(result, x) for x in inputs):
            COUNTS["kernels"] += 1
        return ndarray(result)
    if isinstance(result, numpy.generic):
        COUNTS["kernels"] += 1
        return ndarray(numpy.asarray(result))
    if isinstance(result, (tuple, list)):  # xp.split, xp.meshgrid, divmod ...
        return type(result)([wrap(r, inputs) for r in result])
    return result


def device_call(fn, *args, **kwargs):
    """fn (a NumPy function or method) on device arguments -> device result, under CuPy's rules."""
    found = []
    args = [unwrap(a, found) for a in args]
    if kwargs:
        kwargs = {k: unwrap(v, found) for k, v in kwargs.items()}
    return wrap(fn(*args, **kwargs), found)


def to_host(a: ndarray) -> numpy.ndarray:
    COUNTS["syncs"] += 1
    return a._a.copy()


def asarray(a, dtype=None, order=None):
    """Host data (NumPy array, list, number) or a device array -> a device array: the way up."""
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    COUNTS["copies_to_device"] += 1  # a copy, not a kernel
    return ndarray(numpy.array(unwrap(a, []) if isinstance(a, (list, tuple)) else a, dtype=dtype, order=order or "K"))


def array(a, dtype=None, copy=True, order="K"):
    """Like asarray, always a new array."""
    if isinstance(a, ndarray):
        return device_call(numpy.array, a, dtype=dtype, order=order)
    return asarray(a, dtype, order)


def asnumpy(a, stream=None):
    """A device array -> a NumPy copy on the host (a synchronization); a NumPy array passes through."""
    return to_host(a) if isinstance(a, ndarray) else numpy.asarray(a)


# ---- the device array ----------------------------------------------------------------------------------


class ndarray:  # noqa: N801  (cupy.ndarray's name)
    """A device array: NumPy computes, CuPy's rules decide what may touch it."""

    __slots__ = ("_a",)
    __hash__ = None

    def __init__(self, a: numpy.ndarray):
        self._a = a

    # the way down: explicit copies and scalars, each a synchronization
    def get(self, stream=None, order="C", out=None):
        return to_host(self)

    def item(self, *args):
        return to_host(self).item(*args)

    def tolist(self):
        return to_host(self).tolist()

    def __array__(self, *args, **kwargs):
        raise TypeError(IMPLICIT)

    def __int__(self):
        return int(self.item())

    def __float__(self):
        return float(self.item())

    def __bool__(self):
        return bool(self.item())

    def __index__(self):
        return operator.index(self.item())

    def __repr__(self):
        return repr(to_host(self)).replace("array(", "device_array(", 1)

    # what is known on the host without touching the device
    shape = property(lambda self: self._a.shape)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    dtype = property(lambda self: self._a.dtype)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: ndarray(self._a.T))

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (ndarray(numpy.asarray(row)) for row in self._a)

    # indexing: an index may come from the host (CuPy copies it up); a value may not
    def __getitem__(self, key):
        key = key._a if isinstance(key, ndarray) else unwrap_index(key)
        return wrap(self._a[key], [self._a])  # a slice is a view: no kernel

    def __setitem__(self, key, value):
        key = key._a if isinstance(key, ndarray) else unwrap_index(key)
        COUNTS["kernels"] += 1
        self._a[key] = unwrap(value, [])

    # NumPy functions on device arrays run here, as CuPy's do; a NumPy array among them raises TypeError
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method != "__call__":
            return device_call(getattr(ufunc, method), *inputs, **kwargs)
        return device_call(ufunc, *inputs, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        return device_call(func, *args, **kwargs)

    # methods (sum, max, reshape, astype, ...): NumPy's, under the same rules
    def __getattr__(self, name):
        if name.startswith("__"):  # NumPy's __array_interface__, __array_struct__, buffers: no way down
            raise AttributeError(name)
        attr = getattr(self._a, name)
        if callable(attr):  # NumPy's unbound method, self among the inputs (a view of it launches nothing)
            return functools.partial(device_call, getattr(numpy.ndarray, name), self)
        return wrap(attr, [self._a])


def unwrap_index(key):
    """An index from the host: integers, slices, None, Ellipsis, lists and NumPy integer arrays pass
    (CuPy copies list and array indices to the device); device arrays inside a tuple are unwrapped."""
    if isinstance(key, tuple):
        return tuple(k._a if isinstance(k, ndarray) else unwrap_index(k) for k in key)
    if isinstance(key, (list, numpy.ndarray)):
        COUNTS["copies_to_device"] += 1
    return key


def operator_named(name):
    """operator.add for "add", operator.and_ for "and" (a keyword)."""
    return getattr(operator, name, None) or getattr(operator, f"{name}_")


def binary(name):
    fn = operator_named(name)

    def op(self, other):
        return device_call(fn, self, other)

    return op


def reflected(name):
    fn = operator_named(name)

    def op(self, other):
        return device_call(fn, other, self)

    return op


def in_place(name):
    fn = getattr(operator, f"i{name}")

    def op(self, other):
        fn(self._a, unwrap(other, []))
        COUNTS["kernels"] += 1
        return self

    return op


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
              "lshift", "rshift"):
    setattr(ndarray, f"__{_name}__", binary(_name))
    setattr(ndarray, f"__r{_name}__", reflected(_name))
    setattr(ndarray, f"__i{_name}__", in_place(_name))
for _name in ("lt", "le", "eq", "ne", "gt", "ge"):
    setattr(ndarray, f"__{_name}__", binary(_name))
def unary(name):
    fn = getattr(operator, name)

    def op(self):
        return device_call(fn, self)

    return op


for _name in ("neg", "pos", "abs", "invert"):
    setattr(ndarray, f"__{_name}__", unary(_name))


# ---- the cupy namespace: NumPy's functions under CuPy's rules, and what CuPy adds ------------------------


def __getattr__(name):
    """xp.exp, xp.matmul, xp.float32, xp.newaxis ...: NumPy's, functions wrapped by device_call."""
    attr = getattr(numpy, name)
    if isinstance(attr, type) or not callable(attr):
        return attr  # dtypes (xp.float32), constants (xp.inf), None (xp.newaxis)
    # made once: later lookups find it in the module (which is why this module calls builtins.any, not any)
    globals()[name] = functools.partial(device_call, attr)
    return globals()[name]


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        raise TypeError(f"Unsupported type {type(a)}: ascontiguousarray takes a device array")
    contiguous = a._a.flags.c_contiguous and (dtype is None or a.dtype == dtype)
    return a if contiguous else device_call(numpy.ascontiguousarray, a, dtype=dtype)


class Stream:
    """The device's one stream: synchronize() is where the host waits."""

    def synchronize(self):
        COUNTS["syncs"] += 1


STREAM = Stream()


class Runtime:
    """cupy.cuda.runtime for one emulated device (number 0); every attribute read is counted."""

    cudaDevAttrMaxSharedMemoryPerBlock = 8
    cudaDevAttrMaxSharedMemoryPerBlockOptin = 97
    cudaDevAttrMultiProcessorCount = 16
    ATTRIBUTES = {8: DEFAULT_SMEM_BYTES, 97: EMULATED_SMEM_OPTIN, 16: 1}

    @staticmethod
    def getDeviceCount():  # noqa: N802  (CuPy's names)
        return 1

    @staticmethod
    def getDevice():  # noqa: N802
        return 0

    @classmethod
    def deviceGetAttribute(cls, attribute, device):  # noqa: N802
        COUNTS["attribute_queries"] += 1
        return cls.ATTRIBUTES[attribute]

    @staticmethod
    def getDeviceProperties(device):  # noqa: N802
        return {"name": b"strict CuPy stand-in (NumPy)"}

    @staticmethod
    def runtimeGetVersion():  # noqa: N802
        return 0


class Device:
    """cupy.cuda.Device(0): ``attributes`` reads every attribute, as CuPy's does."""

    def __init__(self, device: int = 0):
        self.id = device
        self.compute_capability = "90"

    @property
    def attributes(self):
        names = {"MaxSharedMemoryPerBlock": 8, "MaxSharedMemoryPerBlockOptin": 97, "MultiProcessorCount": 16}
        return {name: Runtime.deviceGetAttribute(code, self.id) for name, code in names.items()}


class OutOfMemoryError(MemoryError):
    """cupy.cuda.memory.OutOfMemoryError."""


class Cuda:
    """cupy.cuda: the runtime, the device, the stream."""

    runtime = Runtime
    Device = Device
    memory = type("memory", (), {"OutOfMemoryError": OutOfMemoryError})

    @staticmethod
    def get_current_stream():
        return STREAM


cuda = Cuda


# ---- RawKernel: the chapter-4 kernel, emulated, after CuPy's launch rules --------------------------------


class RawKernel:
    """cupy.RawKernel(code, name) for the kernels of kernels/flash_attention.cu and flash_attention_v2.cu,
    run by the g++ emulation."""

    def __init__(self, code: str, name: str, options=(), **kwargs):
        if name not in KERNELS:
            raise NotImplementedError(f"the strict stand-in runs only {', '.join(KERNELS)}, not {name}")
        self.code, self.name, self.kernel = code, name, KERNELS[name]
        self.max_dynamic_shared_size_bytes = 0  # CuPy's opt-in attribute: 0 until set

    def source_file(self):
        """The code as a .cu file in the kernel cache (one per distinct code), for build_emulator."""
        folder = kernel_cache_dir() / f"rawkernel-{hashlib.sha256(self.code.encode()).hexdigest()[:16]}"
        folder.mkdir(exist_ok=True)
        path = folder / self.kernel.source.name
        if not path.exists():
            path.write_text(self.code)
        return path

    def __call__(self, grid, block, args, *, shared_mem: int = 0, stream=None):
        grid, block = tuple(grid), tuple(block)
        if not (1 <= len(grid) <= 3 and 1 <= len(block) <= 3) or not builtins.all(
            isinstance(n, int) and n >= 1 for n in grid + block
        ):
            raise ValueError(f"grid and block are tuples of 1 to 3 positive ints, got {grid}, {block}")
        if shared_mem > builtins.max(DEFAULT_SMEM_BYTES, self.max_dynamic_shared_size_bytes):
            raise RuntimeError(f"CUDA_ERROR_INVALID_VALUE: {shared_mem} bytes of dynamic shared memory need the "
                               f"opt-in (max_dynamic_shared_size_bytes = {self.max_dynamic_shared_size_bytes})")
        if block[1:] not in ((), (1,), (1, 1)):
            raise NotImplementedError("the emulated launcher takes one-dimensional blocks")
        host_args = check_kernel_args(args, self.kernel.params)
        COUNTS["kernels"] += 1
        lib = build_emulator(self.source_file(), shared_bytes=EMULATED_SMEM_OPTIN, kernel=self.kernel)
        run_emulated(lib, host_args, (grid + (1, 1))[:3], block[0], shared_mem, self.name)


def check_kernel_args(args, params) -> list:
    """The launch arguments by CuPy's rules against the kernel's parameters (ctypes types) -> what the
    emulator takes (the device arrays' NumPy buffers, written in place; the scalars)."""
    import ctypes

    if not isinstance(args, (tuple, list)) or len(args) != len(params):
        raise TypeError(f"the kernel takes a tuple of {len(params)} arguments")
    pointer = {ctypes.POINTER(ctypes.c_float): numpy.float32, ctypes.POINTER(ctypes.c_int): numpy.int32}
    scalar = {ctypes.c_int: numpy.int32, ctypes.c_float: numpy.float32}
    out = []
    for i, (arg, param) in enumerate(zip(args, params)):
        if param in pointer:
            if not isinstance(arg, ndarray):
                raise TypeError(f"kernel argument {i}: a {type(arg).__name__} where a device array is needed")
            if arg.dtype != pointer[param] or not arg.flags.c_contiguous:
                raise TypeError(f"kernel argument {i}: a {arg.dtype} array (contiguous: {arg.flags.c_contiguous})"
                                f" where a C-contiguous {numpy.dtype(pointer[param])} array is needed")
            out.append(arg._a)
        elif type(arg) is not scalar[param]:
            raise TypeError(f"kernel argument {i}: a {type(arg).__name__} where numpy.{scalar[param].__name__} is"
                            " needed (CuPy passes a Python int as int64 and a float as double)")
        else:
            out.append(arg)
    return out
