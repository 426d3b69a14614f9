"""Arrays in and out of the native module.

The native side sees every array as a flat ``uint8`` view of C-contiguous
memory plus a dtype name and a shape, and hands results back as flat arrays
that own the runtime's buffer (float16/bfloat16 as uint16). Everything here
is cheap: views, reshapes, and a copy only where documented (a
non-contiguous or non-native-byte-order array is copied before a send).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np

try:  # bfloat16 comes from ml_dtypes, when it is installed.
    import ml_dtypes as _ml_dtypes  # type: ignore[import-not-found, import-untyped, unused-ignore]

    BFLOAT16: Any = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    _ml_dtypes = None  # type: ignore[assignment]
    BFLOAT16 = None

#: The dtype names the runtime carries.
DTYPES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
    "uint64", "float16", "bfloat16", "float32", "float64",
)
_HALF = ("float16", "bfloat16")

# The fast paths below: `dtype.name` costs microseconds (numpy builds the
# string at every access), a dict lookup by dtype tens of nanoseconds, which
# is most of a small message's cost on the Python side. The keys are the
# supported dtypes in native byte order (a dtype of the other byte order is
# not equal to them and takes the general path).
_NATIVE = {np.dtype(n): n for n in DTYPES if n != "bfloat16"}
if BFLOAT16 is not None:
    _NATIVE[BFLOAT16] = "bfloat16"
_HALF_DTYPES = frozenset(d for d, n in _NATIVE.items() if n in _HALF)
_U8 = np.dtype(np.uint8)


def np_dtype(dtype: Any) -> np.dtype:
    """A numpy dtype from a dtype, a type or a name ("float32", "bfloat16", a
    torch dtype's name...); raises TypeError naming anything unsupported."""
    if isinstance(dtype, str) and dtype.startswith("torch."):
        dtype = dtype[len("torch."):]
    elif type(dtype).__module__ == "torch":  # a torch.dtype
        dtype = str(dtype)[len("torch."):]
    if isinstance(dtype, str) and dtype == "bfloat16":
        if BFLOAT16 is None:
            raise TypeError("dtype 'bfloat16' needs the ml_dtypes package (pip install ml_dtypes)")
        return BFLOAT16
    aliases = {"float": "float32", "double": "float64", "half": "float16",
               "long": "int64", "int": "int32"}
    if isinstance(dtype, str):
        dtype = aliases.get(dtype, dtype)
    try:
        d = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"not a dtype: {dtype!r}") from e
    if d.name not in DTYPES:
        raise TypeError(f"unsupported dtype {d!r} (supported: {', '.join(DTYPES)})")
    return d


ALIGNMENT = 64
"""Byte alignment of the arrays :func:`zeros` and :func:`empty` make."""


def dims(shape: Any) -> Tuple[int, ...]:
    """``shape`` (an int or a sequence of ints) as a tuple of dimensions:
    TypeError for anything else (a float, a bool, a string), ValueError for
    a negative one, each naming the shape given."""
    def is_int(d: Any) -> bool:
        return isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_))

    if isinstance(shape, np.ndarray) and shape.ndim == 0:
        shape = shape.item()  # a 0-d array: its one value
    if is_int(shape):
        shape = (shape,)
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}")
    out = tuple(shape)
    if not all(is_int(d) for d in out):
        raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}")
    if any(d < 0 for d in out):
        raise ValueError(f"shape must not have negative dimensions, got {shape!r}")
    return tuple(int(d) for d in out)


def _aligned(alloc: Any, shape: Any, dtype: Any) -> np.ndarray:
    d = np_dtype(dtype)
    dims_ = dims(shape)
    n = int(np.prod(dims_, dtype=np.int64)) * d.itemsize
    raw = alloc(n + ALIGNMENT, dtype=np.uint8)
    at = (-raw.ctypes.data) % ALIGNMENT
    return raw[at:at + n].view(d).reshape(dims_)


def zeros(shape: Any, dtype: Any = "float32") -> np.ndarray:
    """A C-contiguous array of zeros whose data starts on a 64-byte boundary.

    Receive into such arrays (and send from them) for the fastest large
    transfers: numpy places every array of about 4 MiB and more 16 bytes
    into a memory page, where the kernel's socket copies run about three
    times slower (docs/benchmarks.md). torch tensors are aligned already.
    The array is a view of a slightly larger one (``.base``), which it keeps
    alive."""
    return _aligned(np.zeros, shape, dtype)


def empty(shape: Any, dtype: Any = "float32") -> np.ndarray:
    """Like :func:`zeros`, without initialising the elements."""
    return _aligned(np.empty, shape, dtype)


class DeviceTensor(TypeError):
    """Raised by :func:`as_array` for a torch CUDA tensor: the World methods
    catch it and take the device path (NCCL, or host staging); anything else
    sees a TypeError."""

    def __init__(self, tensor: Any, what: str) -> None:
        super().__init__(f"{what}: a CUDA tensor ({tensor.device}) is only accepted by World methods")
        self.tensor = tensor


def device_kind(obj: Any) -> str:
    """Where a tensor's data lives, as the World methods decide it:
    ``"host"`` (numpy arrays, CPU torch tensors, other host objects),
    ``"cuda"`` (a torch CUDA tensor: NCCL or host staging) or
    ``"other"`` (any other torch device, e.g. ``"meta"``: refused)."""
    if type(obj).__module__.startswith("torch"):
        dev = getattr(obj, "device", None)
        if dev is not None and dev.type != "cpu":
            return "cuda" if dev.type == "cuda" else "other"
    return "host"


def as_array(obj: Any, what: str = "tensor") -> np.ndarray:
    """A numpy array over ``obj`` without a copy where possible: numpy arrays
    as they are, torch CPU tensors through ``.numpy()`` (shares memory),
    objects with ``__dlpack__`` through ``np.from_dlpack``; anything else is
    refused with a TypeError naming its type. A torch CUDA tensor raises
    :class:`DeviceTensor` (a TypeError) for the World methods to catch."""
    if isinstance(obj, np.ndarray):
        return obj
    if type(obj).__module__.startswith("torch"):
        if getattr(obj, "device", None) is not None and obj.device.type != "cpu":
            if obj.device.type == "cuda":
                raise DeviceTensor(obj, what)
            raise TypeError(f"{what}: only CPU tensors are supported (and CUDA tensors, by World "
                            f"methods), got one on {obj.device}")
        if str(obj.dtype) == "torch.bfloat16":
            import torch  # type: ignore[import-not-found, import-untyped, unused-ignore]  # only reached when torch is installed

            if BFLOAT16 is None:
                raise TypeError("bfloat16 tensors need the ml_dtypes package")
            return obj.detach().view(torch.int16).numpy().view(BFLOAT16)
        return obj.detach().numpy()
    if hasattr(obj, "__dlpack__"):
        if not hasattr(np, "from_dlpack"):
            raise TypeError(f"{what}: __dlpack__ objects need numpy 1.23 or later "
                            f"(this is numpy {np.__version__})")
        return np.from_dlpack(obj)
    if isinstance(obj, np.generic):
        return np.asarray(obj)
    raise TypeError(f"{what} must be a numpy array, a CPU torch tensor or a __dlpack__ object, "
                    f"got {type(obj).__name__}")


def check_dtype(arr: np.ndarray, what: str = "tensor") -> str:
    """The runtime's name of ``arr``'s dtype; TypeError if unsupported."""
    name = _NATIVE.get(arr.dtype)
    if name is not None:
        return name
    name = arr.dtype.name
    if name not in DTYPES:
        raise TypeError(f"{what}: unsupported dtype {arr.dtype!r} (supported: {', '.join(DTYPES)})")
    return name


def send_view(obj: Any, what: str = "tensor") -> Tuple[np.ndarray, str, Tuple[int, ...]]:
    """``(flat uint8 view, dtype name, shape)`` of an input. No copy for a
    C-contiguous native-byte-order array; otherwise one copy is made."""
    if type(obj) is np.ndarray and obj.flags.c_contiguous:
        name = _NATIVE.get(obj.dtype)
        if name is not None:
            return obj.reshape(-1).view(_U8), name, obj.shape
    arr = as_array(obj, what)
    name = check_dtype(arr, what)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr.reshape(-1).view(np.uint8), name, arr.shape


def out_spec(obj: Any, what: str = "output") -> Tuple[np.ndarray, Tuple[str, Tuple[int, ...]]]:
    """``(array, (dtype name, shape))`` of an output the caller passed; the
    array must be writeable (checked before anything runs)."""
    if type(obj) is np.ndarray and obj.flags.writeable and not _overlaps_itself(obj):
        name = _NATIVE.get(obj.dtype)
        if name is not None:
            return obj, (name, obj.shape)
    if isinstance(obj, np.generic):
        raise TypeError(f"{what} must be an array to write into, got the scalar {obj!r} "
                        f"(it has no memory of its own: the result would be lost)")
    arr = as_array(obj, what)
    name = check_dtype(arr, what)
    if not arr.flags.writeable:
        if not isinstance(obj, np.ndarray) and hasattr(obj, "__dlpack__") \
                and not type(obj).__module__.startswith("torch"):
            raise ValueError(f"{what} is read-only: numpy made its view of this __dlpack__ object "
                             f"read-only (a producer without versioned DLPack, or numpy older than "
                             f"2.2.5); pass a numpy array or a torch tensor as an output")
        raise ValueError(f"{what} is read-only: an output array must be writeable")
    if _overlaps_itself(arr):
        raise ValueError(f"{what} has elements that share memory (a stride of 0, as from torch's "
                         f"expand, strides {arr.strides}): an output needs one place per element")
    return arr, (name, arr.shape)


def _overlaps_itself(arr: np.ndarray) -> bool:
    """Whether two elements of ``arr`` are the same memory: a zero stride on
    an axis of more than one element (torch's ``expand``; numpy's own
    broadcasts are read-only). A C-contiguous array never does."""
    if arr.flags.c_contiguous:
        return False
    return any(st == 0 and n > 1 for st, n in zip(arr.strides, arr.shape))


def writable_bytes(arr: np.ndarray) -> Optional[np.ndarray]:
    """A flat ``uint8`` view of ``arr``'s own memory when the runtime can
    write its result there directly (C-contiguous, aligned, native byte
    order, writeable, not bool); ``None`` otherwise (the caller then copies through
    :func:`write`)."""
    # bool arrays copy: the runtime would have to check every byte of one it
    # writes into (numpy allows bytes other than 0 and 1 in np.empty ones).
    if (arr.flags.c_contiguous and arr.flags.writeable and arr.flags.aligned and arr.dtype.isnative
            and arr.dtype != np.bool_):
        return arr.reshape(-1).view(np.uint8)
    return None


def from_flat(flat: np.ndarray, dtype: np.dtype, shape: Sequence[int]) -> np.ndarray:
    """The runtime's flat result as an array of ``dtype`` and ``shape`` (views only)."""
    if dtype.name in _HALF:
        # The runtime's bits are in this machine's byte order: view them as
        # the native half type, then convert to the asked order if another.
        flat = flat.view(dtype.newbyteorder("="))
        if not dtype.isnative:
            flat = flat.astype(dtype)
    return flat.reshape(shape)


def write(dst: np.ndarray, flat: np.ndarray) -> None:
    """Copies a flat result into the caller's array (any strides)."""
    d = dst.dtype
    if d in _HALF_DTYPES:
        flat = flat.view(d)
    elif not d.isnative and d.name in _HALF:
        # The runtime's bits are in this machine's order: viewed as the
        # native half type, and copyto below swaps them into the other.
        flat = flat.view(d.newbyteorder("="))
    if dst.flags.c_contiguous and flat.dtype == d and flat.size == dst.size:
        # The common case: a plain copy into the array's flat view (a view,
        # since the array is C-contiguous).
        dst.reshape(-1)[...] = flat
        return
    np.copyto(dst, flat.reshape(dst.shape), casting="equiv")
