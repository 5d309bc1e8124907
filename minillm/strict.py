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

- stream capture (``stream.begin_capture()`` ... ``end_capture()`` -> a ``Graph``, CuPy's API): while a
  stream records, nothing runs; each kernel is recorded on the buffers it reads and writes (a new array is
  filled with NaN until a replay writes it), and ``graph.launch()`` reruns the recording, counted as one
  graph launch. What a CUDA graph cannot hold is refused with a ``CaptureError`` naming the line: a
  synchronization (``int(a)``, ``.get()``, ``bool(a)``: a Python branch on a device value), a copy from the
  host, an array whose size depends on device data (``nonzero``, a boolean mask), a kernel's first launch
  (its compile) and another capture.

``COUNTS`` holds the running totals (kernels, syncs, attribute queries, host-to-device copies, graph launches).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import hashlib
import operator
import traceback
from collections import Counter
from pathlib import Path

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
COUNTS: Counter = Counter()  # kernels, syncs, attribute_queries, copies_to_device, graph_launches
IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. "
            "Please use `.get()` to construct a NumPy array explicitly.")  # CuPy's own message


def reset_counts() -> None:
    COUNTS.clear()


# ---- stream capture: what a CUDA graph records, and what it refuses ------------------------------------------


class CaptureError(RuntimeError):
    """An operation that a CUDA graph cannot record, met while a stream was capturing."""


class Recording:
    """The operations recorded by the capture in progress (None when no stream captures)."""

    ops: list | None = None


RECORDING = Recording()
DATA_SIZED = {"nonzero", "flatnonzero", "argwhere", "unique", "compress", "extract", "bincount"}  # sized by values


def caller_line() -> str:
    """file:line (code) of the innermost frame outside this module, NumPy and functools: the user's line."""
    numpy_dir = str(Path(numpy.__file__).parent)
    for frame in reversed(traceback.extract_stack()):
        if frame.filename not in (__file__, functools.__file__) and not frame.filename.startswith(numpy_dir):
            return f"{Path(frame.filename).name}:{frame.lineno} ({(frame.line or '').strip()})"
    return "?"


def refuse_in_capture(what: str) -> None:
    """Raise CaptureError if a stream is capturing: ``what`` cannot be recorded into a CUDA graph."""
    if RECORDING.ops is not None:
        raise CaptureError(f"{what} inside a CUDA graph capture, at {caller_line()}")


def mutate(run) -> None:
    """A kernel that writes existing arrays (``a[...] = b``, ``a += b``, ``out=``, a RawKernel): run it now, or
    record it while a stream captures."""
    COUNTS["kernels"] += 1
    if RECORDING.ops is None:
        run()
    else:
        RECORDING.ops.append(run)


def record_call(fn, args, kwargs, found):
    """``fn`` during a capture: computed once to learn its result's shape and dtype, which then holds NaN (or
    its dtype's smallest value) until a replay writes it; a view of an input records nothing."""
    if getattr(fn, "__name__", "") in DATA_SIZED or (getattr(fn, "__name__", "") == "where" and len(args) == 1):
        refuse_in_capture(f"{fn.__name__}(): an array whose size depends on device data")
    if "out" in kwargs:
        mutate(lambda: fn(*args, **kwargs))
        return ndarray(kwargs["out"])
    result = fn(*args, **kwargs)
    if isinstance(result, (tuple, list)):  # arrays (xp.split) are recorded; numbers (numpy.shape's) are what they are
        return type(result)(r if not isinstance(r, (numpy.ndarray, numpy.generic)) else wrap(r, found)
                            if is_view(r, found) else recorded(r, lambda i=i: fn(*args, **kwargs)[i])
                            for i, r in enumerate(result))
    return wrap(result, found) if is_view(result, found) else recorded(result, lambda: fn(*args, **kwargs))


def is_view(result, inputs) -> bool:
    return type(result) is numpy.ndarray and result.base is not None and builtins.any(
        numpy.may_share_memory(result, x) for x in inputs)


def recorded(result, compute) -> ndarray:
    """A new array made during a capture: poisoned now, written by ``compute`` at each replay."""
    buf = numpy.array(result, copy=True)
    buf[...] = numpy.nan if buf.dtype.kind in "fc" else (numpy.iinfo(buf.dtype).min if buf.dtype.kind in "iu" else 0)
    mutate(lambda: numpy.copyto(buf, compute()))
    return ndarray(buf)


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
    """fn (a NumPy function or method) on device arguments -> device result, under CuPy's rules (recorded,
    not run, while a stream captures)."""
    found = []
    args = [unwrap(a, found) for a in args]
    if kwargs:
        kwargs = {k: unwrap(v, found) for k, v in kwargs.items()}
    if RECORDING.ops is not None:
        return record_call(fn, args, kwargs, found)
    if "out" in kwargs:  # a kernel that writes an existing array
        COUNTS["kernels"] += 1
        return ndarray(fn(*args, **kwargs))
    return wrap(fn(*args, **kwargs), found)


def to_host(a: ndarray, what: str = "a synchronization (the host reads a device array)") -> numpy.ndarray:
    refuse_in_capture(what)
    COUNTS["syncs"] += 1
    return a._a.copy()


def asarray(a, dtype=None, order=None):
    """Host data (NumPy array, list, number) or a device array -> a device array: the way up."""
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    refuse_in_capture("a copy from the host to the device")
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
        return bool(to_host(self, "a Python branch on a device value (bool() waits for the device)").item())

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
        key = unwrap_index(key)
        if RECORDING.ops is not None:
            return record_call(operator.getitem, [self._a, key], {}, [self._a])
        return wrap(self._a[key], [self._a])  # a slice is a view: no kernel

    def __setitem__(self, key, value):
        key = unwrap_index(key)
        value, a = unwrap(value, []), self._a
        mutate(lambda: a.__setitem__(key, value))

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
        if callable(attr) and name in IN_PLACE_METHODS:  # a.fill(0), a.sort(): a kernel on a itself
            return lambda *args, **kwargs: mutate(lambda: attr(*unwrap(args, []), **kwargs))
        if callable(attr):  # NumPy's unbound method, self among the inputs (a view of it launches nothing)
            return functools.partial(device_call, getattr(numpy.ndarray, name), self)
        return wrap(attr, [self._a])


IN_PLACE_METHODS = {"fill", "sort", "put", "partition", "itemset", "resize"}


def unwrap_index(key):
    """An index from the host: integers, slices, None, Ellipsis, lists and NumPy integer arrays pass
    (CuPy copies list and array indices to the device); device arrays inside a tuple are unwrapped. A boolean
    device array (a mask) selects as many elements as it holds True: refused while a stream captures."""
    if isinstance(key, tuple):
        return tuple(unwrap_index(k) for k in key)
    if isinstance(key, ndarray):
        if key.dtype == bool:
            refuse_in_capture("a boolean mask index: an array whose size depends on device data")
        return key._a
    if isinstance(key, (list, numpy.ndarray)):
        refuse_in_capture("a host index (a copy from the host to the device)")
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
        a, other = self._a, unwrap(other, [])
        mutate(lambda: fn(a, other))
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


class Graph:
    """A recorded stream capture (cupy.cuda.graph.Graph): ``launch`` reruns every recorded kernel, in order,
    on the buffers it recorded, with the scalars it recorded: one launch from the host."""

    def __init__(self, ops: list):
        self.ops = ops

    def launch(self, stream=None):
        refuse_in_capture("a graph launch")
        COUNTS["graph_launches"] += 1
        for run in self.ops:
            run()


class Stream:
    """A stream: ``synchronize()`` is where the host waits; ``with stream:`` makes it the current one, and
    ``begin_capture()`` ... ``end_capture()`` records what is issued meanwhile into a ``Graph``."""

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        self.null = null

    def synchronize(self):
        refuse_in_capture("a stream synchronization")
        COUNTS["syncs"] += 1

    def __enter__(self):
        STREAMS.append(self)
        return self

    def __exit__(self, *exc):
        STREAMS.pop()

    def begin_capture(self, mode=None):
        if self.null:
            raise RuntimeError("cudaErrorStreamCaptureUnsupported: the legacy default stream cannot capture")
        if Cuda.get_current_stream() is not self:
            raise RuntimeError("begin_capture on a stream that is not the current one: record inside `with stream:`")
        refuse_in_capture("another begin_capture")
        RECORDING.ops = []

    def is_capturing(self) -> bool:
        return RECORDING.ops is not None

    def end_capture(self) -> Graph:
        if RECORDING.ops is None:
            raise RuntimeError("end_capture on a stream that is not capturing")
        graph, RECORDING.ops = Graph(RECORDING.ops), None
        return graph


STREAM = Stream(null=True)
STREAMS: list = []  # the streams entered with `with`, innermost last


class MemoryPool:
    """cupy.cuda.MemoryPool: the stand-in's arrays are NumPy's, so its malloc only marks where CuPy's would be."""

    def malloc(self, size: int):
        raise NotImplementedError("the strict stand-in allocates with NumPy")


@contextlib.contextmanager
def using_allocator(allocator=None):
    """cupy.cuda.using_allocator: allocations in the block come from ``allocator`` (here: NumPy's, always)."""
    yield


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
    Stream = Stream
    Graph = Graph
    MemoryPool = MemoryPool
    using_allocator = staticmethod(using_allocator)
    memory = type("memory", (), {"OutOfMemoryError": OutOfMemoryError})

    @staticmethod
    def get_current_stream():
        return STREAMS[-1] if STREAMS else STREAM


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
        self.lib = None  # the emulator, built at the first launch (CuPy compiles at the first launch too)

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
        host_args = check_kernel_args(args, self.kernel.signature(self.name))
        if self.lib is None:
            refuse_in_capture(f"the first launch of {self.name} (its compile and module load)")
            self.lib = build_emulator(self.source_file(), shared_bytes=EMULATED_SMEM_OPTIN, kernel=self.kernel)
        lib, grid3, name = self.lib, (grid + (1, 1))[:3], self.name
        mutate(lambda: run_emulated(lib, host_args, grid3, block[0], shared_mem, name))


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
