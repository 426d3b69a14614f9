"""Torch CUDA tensors in World methods (see docs/python.md, "Device tensors").

The World methods run their host path first; a CUDA tensor among their
arguments raises :class:`~multiworld_rs._tensors.DeviceTensor` there (before
anything is sent), and the method hands its arguments to :func:`run`:

- **NCCL worlds** (``backend="nccl"``, the ``nccl`` build): p2p and the
  collectives NCCL has run on the tensors' own device memory (no copy: the
  runtime borrows it), ordered on the device after torch's current stream
  (the host does not wait for it); the
  call (or the async ``Work``) completes when the NCCL operation has.
- **The list forms** (``all_gather``, ``gather``, ``scatter``,
  ``reduce_scatter``, ``all_to_all``) in NCCL worlds: through one flat
  device tensor (inputs copied into it on torch's stream, the flat NCCL
  operation, outputs copied out of it when the call or ``Work.wait()``
  returns), when every tensor of the call is a CUDA tensor of one device,
  dtype and size.
- **Everything else** (TCP worlds, sub-groups, uneven lists and splits):
  host staging. CUDA inputs are copied to pinned host tensors (torch's
  host allocator reuses them from call to call; see :data:`PINNED_MAX`),
  CUDA outputs get one, the
  host path runs, and the results are copied back with ``tensor.copy_()``
  when the call (or ``Work.wait()``) returns.

Nothing here runs unless a CUDA tensor was passed: the host path pays only
for a ``try`` block.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

from . import _native
from . import _tensors as T

#: Whether this build of the native module has the ``nccl`` feature.
NCCL_BUILT: bool = bool(_native.nccl_built())

#: Per method: the arguments it writes (copied back after host staging).
OUTPUTS: Dict[str, Tuple[str, ...]] = {
    "send": (), "isend": (),
    "recv_into": ("tensor",), "irecv": ("tensor",),
    "broadcast": ("tensor",), "all_reduce": ("tensor",), "reduce": ("tensor",),
    "all_gather": ("tensor_list",), "all_gather_into_tensor": ("output_tensor",),
    "gather": ("gather_list",), "scatter": ("tensor",),
    "reduce_scatter": ("output",), "reduce_scatter_tensor": ("output",),
    "all_to_all": ("output_tensor_list",), "all_to_all_single": ("output",),
}

#: Outputs that are also inputs (their data goes in, the result comes back).
IN_PLACE = {("broadcast", "tensor"), ("all_reduce", "tensor"), ("reduce", "tensor")}


def is_cuda(t: Any) -> bool:
    """Whether ``t`` is a torch CUDA tensor."""
    return T.device_kind(t) == "cuda"


# -- host staging ---------------------------------------------------------------
def _stage(value: Any, out: bool, keep_data: bool, copies: List[Tuple[Any, Any]]) -> Any:
    """The host stand-in of one argument (a tensor, a list of them, or
    anything else, returned as is); CUDA outputs are recorded in ``copies``."""
    if isinstance(value, list):
        return [_stage(v, out, keep_data, copies) for v in value]
    if not is_cuda(value):
        return value
    host = _host_like(value)
    if keep_data or not out:
        host.copy_(value.detach())  # waits for torch's stream, like any D2H copy
    if out:
        copies.append((value, host))
    return host


#: The largest tensor staged through pinned memory, in bytes
#: (``MULTIWORLD_PINNED_STAGING_MAX_MIB``, default 256; 0 turns pinned
#: staging off). torch's host allocator keeps every pinned block it made,
#: rounded up to a power of two, for reuse until the process ends
#: (``torch._C._host_emptyCache()`` frees the idle ones): the cap bounds
#: what one staged tensor can lock.
PINNED_MAX: int = int(os.environ.get("MULTIWORLD_PINNED_STAGING_MAX_MIB", "256")) << 20
_pinning_failed = False


def _host_like(value: Any) -> Any:
    """A contiguous host tensor of ``value``'s shape and dtype, in pinned
    (page-locked) memory up to :data:`PINNED_MAX` bytes: torch's host
    allocator keeps freed pinned blocks for the next call of the same size,
    so a stream of staged tensors neither faults in fresh pages nor pins
    memory again, and the copies run at the bus's rate (measured on an
    H100: 64 MiB to a new pageable tensor 1.3 GB/s, into pinned memory
    53 GB/s). Pageable memory above the cap, and from the first time
    pinning fails (a limit on locked memory) on."""
    global _pinning_failed
    if not _pinning_failed and value.numel() * value.element_size() <= PINNED_MAX:
        try:
            return value.new_empty(value.shape, device="cpu", pin_memory=True)
        except RuntimeError:
            _pinning_failed = True
    return value.new_empty(value.shape, device="cpu")


def staged(world: Any, name: str, args: Dict[str, Any]) -> Any:
    """Runs method ``name`` of ``world`` on host copies of its CUDA tensors
    and copies its outputs back (at once, or in ``Work.wait()``)."""
    outs = OUTPUTS[name]
    if name == "gather" and world.rank != args["dst"]:
        outs = ()  # gather_list is ignored off the destination: leave it alone
    copies: List[Tuple[Any, Any]] = []
    host = {k: _stage(v, k in outs, (name, k) in IN_PLACE, copies) for k, v in args.items()}
    by_id = {id(host[k]): args[k] for k in outs}

    def back(result: Any) -> Any:
        for dev, h in copies:
            dev.detach().copy_(h)  # in place, outside autograd (as torch.distributed)
        return by_id.get(id(result), result)

    result = getattr(world, name)(**host)
    from ._api import Work  # here: _api imports this module

    if isinstance(result, Work):
        before = result._finish
        result._finish = lambda raw: back(before(raw) if before is not None else raw)
        return result
    return back(result)


# -- NCCL worlds ------------------------------------------------------------------
def _mem(t: Any, nccl: Any, what: str, out: bool) -> Tuple[Tuple[int, str, int], Any]:
    """``((data_ptr, dtype name, numel), tensor)`` of a CUDA tensor for the
    NCCL world ``nccl``: on its device, a supported dtype; an output must be
    contiguous (an input is made contiguous, a copy)."""
    if not is_cuda(t):
        raise TypeError(f"{what}: an NCCL world's operation takes CUDA tensors for all its "
                        f"tensors, or host tensors for all (got {type(t).__name__} on "
                        f"{getattr(t, 'device', 'the host')})")
    if t.device.index != nccl.device:
        raise ValueError(f"{what} is on {t.device} but this NCCL world uses cuda:{nccl.device}")
    name = str(t.dtype).replace("torch.", "")
    if name not in T.DTYPES:
        raise TypeError(f"{what}: unsupported dtype {t.dtype} (supported: {', '.join(T.DTYPES)})")
    if not t.is_contiguous():
        if out:
            raise ValueError(f"{what} must be contiguous in an NCCL world (it is written in place)")
        t = t.contiguous()
    return (int(t.data_ptr()), name, int(t.numel())), t


def _order(nccl: Any, t: Any) -> None:
    """Orders the NCCL world's next operation behind torch's current stream
    on ``t``'s device, on the device (an event recorded on torch's stream
    that the world's stream waits for): the tensors' producers are done
    before NCCL reads them, and the host does not wait for them, as with
    torch.distributed."""
    import torch  # type: ignore[import-not-found, import-untyped, unused-ignore]

    nccl.after_stream(torch.cuda.current_stream(t.device).cuda_stream)


def nccl_run(world: Any, nccl: Any, name: str, args: Dict[str, Any]) -> Any:
    """Runs method ``name`` on the NCCL world ``nccl``; ``NotImplemented``
    for what NCCL does not offer here (then the caller stages over TCP)."""
    from ._api import Work, _op, _opt_rank, _u32

    a = args
    async_op = bool(a.get("async_op", False))
    p2p = name in ("send", "isend", "recv_into", "irecv")
    # A blocking call waits in the native call, on this thread (no task).
    wait = not async_op and name not in ("isend", "irecv")

    def finish(native: Any, result: Any, on_done: Any = None) -> Any:
        def fin(_raw: Any) -> Any:
            if on_done is not None:
                on_done()
            return result

        w = Work(native, fin)
        if async_op or name in ("isend", "irecv"):
            return w
        w.wait()
        return None  # as the host path's blocking forms

    if p2p:
        t = a["tensor"]
        if _u32("tag", a["tag"]) != 0:
            raise ValueError(f"{name}: NCCL point-to-point has no tags (tag must be 0; host tensors "
                             "travel over the world's TCP mesh with tags)")
        out = name in ("recv_into", "irecv")
        mem, t2 = _mem(t, nccl, "tensor", out)
        _order(nccl, t)
        if out:
            src = _opt_rank("src", a["src"])
            if src is None:
                raise ValueError(f"{name}: an NCCL receive needs src (NCCL cannot receive from any rank)")
            native = nccl.recv(mem, src, [t], wait)
            if name == "recv_into":
                Work(native).wait()
                return src
            w = Work(native)
            w.source = src  # type: ignore[attr-defined]
            w._finish = lambda _raw: t
            return w
        native = nccl.send(mem, _u32("dst", a["dst"]), [t, t2], wait)
        return finish(native, None)

    if name in ("broadcast", "all_reduce", "reduce"):
        t = a["tensor"]
        mem, _ = _mem(t, nccl, "tensor", True)
        _order(nccl, t)
        if name == "broadcast":
            native = nccl.broadcast(mem, _u32("src", a["src"]), [t], wait)
        elif name == "all_reduce":
            native = nccl.all_reduce(mem, _op(a["op"]), [t], wait)
        else:
            native = nccl.reduce(mem, _u32("dst", a["dst"]), _op(a["op"]), [t], wait)
        return finish(native, t)

    pairs = {
        "all_gather_into_tensor": ("input_tensor", "output_tensor"),
        "reduce_scatter_tensor": ("input", "output"),
        "all_to_all_single": ("input", "output"),
    }
    if name in pairs:
        if name == "all_to_all_single" and (a["output_split_sizes"] is not None
                                            or a["input_split_sizes"] is not None):
            return NotImplemented  # uneven splits: staged
        i_name, o_name = pairs[name]
        src, dst = a[i_name], a[o_name]
        smem, s2 = _mem(src, nccl, i_name, False)
        dmem, _ = _mem(dst, nccl, o_name, True)
        _order(nccl, dst)
        keep = [src, s2, dst]
        if name == "all_gather_into_tensor":
            native = nccl.all_gather(smem, dmem, keep, wait)
        elif name == "reduce_scatter_tensor":
            native = nccl.reduce_scatter(smem, dmem, _op(a["op"]), keep, wait)
        else:
            native = nccl.all_to_all(smem, dmem, keep, wait)
        return finish(native, dst)
    if name in _LIST_FORMS:
        return _list_form(world, nccl, name, a, wait, finish)
    return NotImplemented


# -- the list forms over NCCL -------------------------------------------------------
#: The collectives with lists of tensors, run over NCCL through one flat device
#: tensor (as torch.distributed's NCCL process group does): the inputs are
#: copied into it on torch's stream, the flat operation runs, and the outputs
#: are copied out of it when the call (or ``Work.wait()``) returns.
_LIST_FORMS = ("all_gather", "gather", "scatter", "reduce_scatter", "all_to_all")


def _alike(ref: Any, ts: Any, n: int) -> bool:
    """Whether ``ts`` is a list of ``n`` CUDA tensors on ``ref``'s device with
    ``ref``'s dtype and number of elements (what one flat NCCL operation
    can serve)."""
    return isinstance(ts, list) and len(ts) == n and all(
        is_cuda(t) and t.device.index == ref.device.index and str(t.dtype) == str(ref.dtype)
        and t.numel() == ref.numel() for t in ts)


def _flat(ref: Any, n: int) -> Any:
    """A new contiguous device tensor of ``n`` blocks of ``ref``'s size (its
    dtype, on its device)."""
    return ref.new_empty((n * ref.numel(),))


def _block(flat: Any, i: int, ref: Any) -> Any:
    """Block ``i`` of ``flat``, a view shaped like ``ref``."""
    k = ref.numel()
    return flat.narrow(0, i * k, k).view(ref.shape)


def _fill(flat: Any, ts: List[Any]) -> None:
    """Copies ``ts`` into the blocks of ``flat``, on torch's stream."""
    for i, t in enumerate(ts):
        _block(flat, i, t).copy_(t.detach())


def _spill(flat: Any, ts: List[Any]) -> Any:
    """A function that copies the blocks of ``flat`` into ``ts`` (in place,
    outside autograd, as torch.distributed does)."""
    def spill() -> None:
        for i, t in enumerate(ts):
            t.detach().copy_(_block(flat, i, t))
    return spill


def _list_form(world: Any, nccl: Any, name: str, a: Dict[str, Any], wait: bool, finish: Any) -> Any:
    """One of :data:`_LIST_FORMS` over NCCL; ``NotImplemented`` (staged
    instead) when its tensors do not fit one flat operation: of several
    shapes, dtypes or devices, host tensors among them, a list not of the
    world's size, or an output written in place that is not contiguous."""
    from ._api import _op, _u32

    n = world.size
    if name == "all_gather":
        outs, t = a["tensor_list"], a["tensor"]
        if not (is_cuda(t) and _alike(t, outs, n)):
            return NotImplemented
        smem, s2 = _mem(t, nccl, "tensor", False)
        flat = _flat(t, n)
        fmem, _ = _mem(flat, nccl, "tensor_list", True)
        _order(nccl, t)
        return finish(nccl.all_gather(smem, fmem, [t, s2, flat], wait), outs, _spill(flat, outs))
    if name == "gather":
        t, outs, dst = a["tensor"], a["gather_list"], _u32("dst", a["dst"])
        root = world.rank == dst
        if not is_cuda(t) or (root and not _alike(t, outs, n)):
            return NotImplemented
        smem, s2 = _mem(t, nccl, "tensor", False)
        flat = _flat(t, n) if root else None
        gmem = _mem(flat, nccl, "gather_list", True)[0] if root else None
        _order(nccl, t)
        native = nccl.gather(smem, gmem, dst, [t, s2, flat], wait)
        return finish(native, outs, _spill(flat, outs) if root else None)
    if name == "scatter":
        t, ins, src = a["tensor"], a["scatter_list"], _u32("src", a["src"])
        root = world.rank == src
        if not (is_cuda(t) and t.is_contiguous()) or (root and not _alike(t, ins, n)):
            return NotImplemented
        rmem, _ = _mem(t, nccl, "tensor", True)
        flat = _flat(t, n) if root else None
        if root:
            _fill(flat, ins)
        lmem = _mem(flat, nccl, "scatter_list", False)[0] if root else None
        _order(nccl, t)
        return finish(nccl.scatter(lmem, rmem, src, [t, flat], wait), t)
    if name == "reduce_scatter":
        out, ins = a["output"], a["input_list"]
        if not (is_cuda(out) and out.is_contiguous() and _alike(out, ins, n)):
            return NotImplemented
        omem, _ = _mem(out, nccl, "output", True)
        flat = _flat(out, n)
        _fill(flat, ins)
        fmem, _ = _mem(flat, nccl, "input_list", False)
        _order(nccl, out)
        return finish(nccl.reduce_scatter(fmem, omem, _op(a["op"]), [out, flat], wait), out)
    # all_to_all
    outs, ins = a["output_tensor_list"], a["input_tensor_list"]
    if not (isinstance(ins, list) and ins and is_cuda(ins[0])
            and _alike(ins[0], ins, n) and _alike(ins[0], outs, n)):
        return NotImplemented
    fin, fout = _flat(ins[0], n), _flat(ins[0], n)
    _fill(fin, ins)
    imem, _ = _mem(fin, nccl, "input_tensor_list", False)
    omem, _ = _mem(fout, nccl, "output_tensor_list", True)
    _order(nccl, ins[0])
    return finish(nccl.all_to_all(imem, omem, [fin, fout], wait), outs, _spill(fout, outs))


def nccl_of(world: Any) -> Optional[Any]:
    """The native NCCL side of ``world`` (cached on it), or ``None``: a TCP
    world, a sub-group, or a build without ``nccl``."""
    n = world._nccl
    if n is False:
        return None
    if n is None:
        n = _native.nccl_world(world._w) if NCCL_BUILT else None
        world._nccl = False if n is None else n
    return n


def run(world: Any, name: str, args: Dict[str, Any]) -> Any:
    """The device path of World method ``name`` (see the module docs)."""
    nccl = nccl_of(world)
    if nccl is not None:
        r = nccl_run(world, nccl, name, args)
        if r is not NotImplemented:
            return r
    return staged(world, name, args)


def device_index(device: Any) -> Optional[int]:
    """A CUDA device ordinal from ``device``: an int, ``"cuda:N"``, a
    ``torch.device`` (``cuda`` without an index: torch's current device), or
    ``None``."""
    if device is None:
        return None
    if isinstance(device, bool):
        raise TypeError(f"device must be a CUDA device (int, 'cuda:N' or torch.device), got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device must be a non-negative CUDA ordinal, got {device}")
        return device
    kind, index = None, None
    if isinstance(device, str):
        kind, _, rest = device.partition(":")
        if rest:
            if not rest.isdigit():
                raise ValueError(f"device must look like 'cuda:N', got {device!r}")
            index = int(rest)
    elif type(device).__module__.startswith("torch"):
        kind, index = device.type, device.index
    else:
        raise TypeError(f"device must be a CUDA device (int, 'cuda:N' or torch.device), got {device!r}")
    if kind != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device!r}")
    if index is None:
        import torch  # type: ignore[import-not-found, import-untyped, unused-ignore]

        index = torch.cuda.current_device()
    return int(index)
