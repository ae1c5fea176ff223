"""Runs over torch tensors on the device the kernels run on (CUDA): inputs read and outputs written in
place through DLPack (luisaml/interop.py), and the host copies of what the host must read (byte inputs,
the sources of host-derived inputs) kept while the tensors stay equal."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from . import counts, dtypes
from .feeds import ZERO_COPY_TOKENS, check_feeds, input_digest, io_dtype, memory_key, voxel_batch
from .interop import check_torch_dtype, dlpack_buffer, is_torch, same_tensor, to_numpy, torch_dtype

if TYPE_CHECKING:
    from .network import CompiledNetwork
    from .plan import IOSpec

# backend -> the torch device type whose memory its kernels read and write in place (tests map
# "cpu" too, to run this path on the CPU backend)
SHARED_DEVICES = {"cuda": "cuda"}


def applies(net: CompiledNetwork, feeds: Mapping[str, Any]) -> bool:
    """True when every input is a torch tensor on the device the kernels run on: numeric inputs are
    read in place, outputs written in place (run-time sized ones included); byte inputs (a grid's
    bytes) and the sources of host-derived inputs are read on the host too (_host_arrays)."""
    plan = net.plan
    kind = SHARED_DEVICES.get(net.backend)
    if kind is None or not feeds or plan.host_outputs:
        return False
    if not all(is_torch(v) and v.device.type == kind for v in feeds.values()):
        return False
    return (all(not s.dtype.is_bool for s in plan.inputs + plan.outputs)
            and not any(s.dtype.is_byte for s in plan.outputs))


def _host_arrays(net: CompiledNetwork, feeds: Mapping[str, Any], metas: dict[str, np.ndarray],
                 seen: dict) -> dict[str, np.ndarray]:
    """Return what the host must read of device feeds: byte inputs (uploaded as a ByteBuffer, which
    DLPack cannot share) and the sources of derived inputs (a grid's metadata is derived on the host,
    recomputed only when their digest changes, as in run() on numpy); a source whose shape alone
    matters keeps its shape-only stand-in and is not copied. A feed equal, compared on the device,
    to what the last run copied keeps that copy and its digest (in seen): a grid bound once is not
    copied to the host and hashed again every run; any change of its contents is a miss."""
    plan, kept = net.plan, net.bound.host_copies
    need = {s.name for s in plan.inputs if s.dtype.is_byte}
    for d in plan.derived:
        need |= {n for n in d.sources if n not in d.constants and n not in d.shape_only}
    host = dict(metas)
    copied: dict = {}  # this run's host copies by device memory: two bundles of one grid, one copy
    changed: list = []  # (name, its tensor, its new host copy)
    for name in sorted(need):
        t = feeds[name].detach()
        where = (t.data_ptr(), t.dtype, str(t.device), tuple(t.shape), t.stride())
        if where in copied:
            host[name] = copied[where]
            continue
        last = kept.get(name)
        if same_tensor(last[0] if last else None, t):
            host[name] = last[1]
            seen[(name, False)] = last[2]
            if last[3] is not None:
                seen[memory_key(last[1])] = last[3]
        else:
            host[name] = np.array(to_numpy(t, name), copy=True)  # (a CPU tensor's numpy() would share it)
            changed.append((name, t, host[name]))
        copied[where] = host[name]
    # A changed tensor differs from its last run's clone, so no cache keyed by its bytes holds it: a
    # token never used before stands for their digest (hashing a 198k-voxel grid's bundle took 5 ms
    # a run on the H200's host). Copies equal to another changed copy of this run (two bundles of
    # one grid in separate memory: compared, at memcmp speed) share its token, so they share one
    # bundle check and one upload.
    firsts: dict = {}  # (dtype, shape) -> the distinct changed copies of this run
    for _, _, a in changed:
        same = firsts.setdefault((a.dtype.str, a.shape), [])
        twin = next((b for b in same if np.array_equal(a, b)), None)
        if twin is None:
            same.append(a)
            seen[memory_key(a)] = b"zero-copy " + next(ZERO_COPY_TOKENS).to_bytes(8, "little")
        else:
            seen[memory_key(a)] = seen[memory_key(twin)]
    for name in need:
        if name not in {n for n, _, _ in changed}:
            input_digest(host, name, False, seen)  # (a copy shared in this run: its memo)
    for name, t, a in changed:
        digest = input_digest(host, name, False, seen)
        kept[name] = (t.clone(), a, digest, seen.get(memory_key(a)))
    return host


def _input_buffer(net: CompiledNetwork, name: str, t):
    """The luisa Buffer sharing input tensor t (contiguous): the last run's where t is the memory of the
    tensor that run bound (its pointer, dtype, shape and device; that tensor is held, so its memory is
    no other's), else a new one. A network fed the same tensors run after run then keeps its buffers,
    and its launches their arguments' encodings (dispatch.Launcher.rebind); the cost is one input's
    tensor held until the next run binds another."""
    kept = net.bound.shared_inputs.get(name)
    if (kept is not None and t.numel() and kept[0].data_ptr() == t.data_ptr() and kept[0].dtype == t.dtype
            and kept[0].shape == t.shape and kept[0].device == t.device):
        return kept[1]
    buf = dlpack_buffer(t)
    net.bound.shared_inputs[name] = (t, buf)
    return buf


def run(net: CompiledNetwork, feeds: Mapping[str, Any], wanted: list[str]) -> dict[str, Any]:
    """run() for torch CUDA tensors: inputs and outputs share memory with LuisaCompute buffers
    through DLPack; torch's stream is drained before the kernel reads, and LuisaCompute's before
    torch sees the outputs (neither library exposes its stream to the other).

    Every output is a tensor allocated for this run, so two runs never share an output's memory (a
    view of a capacity buffer kept by the network would be overwritten by the next run while the
    caller still holds the first one): a run-time sized one (luisaml/dynamic.py) counted on the device
    is allocated at its capacity and returned as the view of its rows (its fill writes them from the
    tensor's start); a HostRead's once its rows are read back, exactly that many. The run's one
    host round trip is its end (the flag and the totals); the data stays on the device."""
    import torch

    plan = net.plan
    metas = {}
    for k, v in feeds.items():  # shape and dtype checks without touching the data
        check_torch_dtype(v, k)
        np_dtype = torch.empty((), dtype=v.dtype).numpy().dtype
        metas[k] = np.broadcast_to(np.zeros((), np_dtype), tuple(v.shape))
    _, batch, _ = check_feeds(plan, metas)
    n = batch if plan.symbol is not None else 1
    net.check_batch(n)
    where = next(iter(feeds.values())).device

    def drain_torch():
        if where.type == "cuda":
            counts.synchronised()
            torch.cuda.current_stream(where).synchronize()

    def kernel_dtype(s: IOSpec):
        return torch_dtype(io_dtype(plan, s).kernel_numpy)

    seen: dict = {}  # this run's input digests
    host = _host_arrays(net, feeds, metas, seen)
    derived = net.bound.derived_buffers(plan, host, seen)  # (a damaged bundle is named here, before the rows)
    # a sparse network's batch: its largest grid's voxels where more than n, its batched inputs padded
    # with zero rows (luisaml/fvdb/voxel_rows.py); its outputs at a grid's level cut to the grid's voxels
    rows = voxel_batch(plan, n, lambda name: host[name] if name in host else feeds[name].detach().cpu().numpy())
    if rows.batch > n:
        net.check_batch(rows.batch)
    items: list = []  # torch tensors (shared through DLPack) or luisa buffers, in parameter order
    for s in plan.inputs:
        if s.dtype.is_byte:
            k = dtypes.to_kernel(host[s.name], io_dtype(plan, s), f"input '{s.name}'")
            items.append(net.bound.byte_input(s, k, seen if k is host[s.name] else None))
            continue
        t = feeds[s.name].detach()
        if io_dtype(plan, s) is dtypes.INT64 and t.numel():
            lo, hi = (int(v) for v in torch.aminmax(t))
            dtypes.to_kernel(np.array([lo, hi]), dtypes.INT64, f"input '{s.name}'")  # range check
        t = t.to(kernel_dtype(s)).contiguous()
        if s.batched and rows.batch > n:
            t = torch.cat([t, torch.zeros(((rows.batch - n) * s.kernel_shape[0],) + tuple(t.shape[1:]), dtype=t.dtype,
                                          device=t.device)])
        items.append(_input_buffer(net, s.name, t))
    outs = {}
    for s in plan.outputs:
        # a run-time sized output starts with no rows: the stages before its read-back never write it
        shape = s.sized_shape(0) if s.rows is not None else s.batch_shape(rows.batch)
        make = torch.zeros if s.accumulated else torch.empty
        outs[s.name] = make(shape, dtype=kernel_dtype(s), device=where)
        items.append(outs[s.name])
    drain_torch()
    args = [dlpack_buffer(x) if is_torch(x) else x for x in items] + derived
    first_out = len(plan.inputs)
    out_bufs = [(s, args[first_out + k], 0) for k, s in enumerate(plan.outputs)]

    def sized(s: IOSpec, rows: int):
        # a fresh tensor of the read-back rows; torch's stream drained again, since its caching
        # allocator may hand out a block that work on torch's stream used last
        t = torch.empty(s.sized_shape(rows), dtype=kernel_dtype(s), device=where)
        outs[s.name] = t
        drain_torch()
        return dlpack_buffer(t)

    counted = net.launcher.run(args, rows.batch, out_bufs, make_output=sized).rows
    for name in plan.counted:  # (a tensor of the capacity: its rows are its first elements)
        spec = next(s for s in plan.outputs if s.name == name)
        outs[name] = outs[name].reshape(-1)[:counted[name] * spec.numel_per_row].view(spec.sized_shape(counted[name]))
    results = {}
    for s in plan.outputs:
        if s.name in wanted:
            out = outs[s.name][:rows.keep[s.name]] if s.name in rows.keep else outs[s.name]
            want = torch_dtype(io_dtype(plan, s).numpy)
            results[s.name] = out if out.dtype == want else out.to(want)
    return {k: results[k] for k in wanted}
