"""Kernel launches that share their arguments, without luisa-python typing each argument per call.

luisa-python's `func.__call__` types every argument twice per launch (dtype_of, to_lctype) before
it looks up the compiled shader and encodes the arguments. A staged network passes every stage the
same ~20 buffers, so on CUDA a device grid build's ~210 launches a run spent ~20 ms of host time
in that typing (cProfile on the H200: dtype_of 7.6k calls a run), against 0.6 ms of device work.
`Launcher` types the shared arguments once and keeps, per argument, the encoder method and its
arguments (a buffer's handle and size, a scalar's bytes); `rebind` keeps those of the arguments that
are the same objects as before (a network's pooled buffers, run after run) and types only the others
(a zero-copy run's fresh output tensors). `prepare` turns (kernel, tail, count) into a `Prepared`
launch, the compiled shader looked up by the same type tuple `__call__` builds (so the first launch of
a kernel still compiles it the same way) and the tail encoded; `enqueue` then only creates the command,
encodes and adds it: what luisa-python's launch does, minus the typing and lookups (benchmarks/NOTES.md,
"net.run's host time": 8.8 -> 2.8 us a launch of 6 buffers on a 2-core Xeon's CPU backend).
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import NamedTuple


def _encoding(lctype, a) -> tuple:
    """Return (encoder method, its arguments after the command) for argument a of LuisaCompute type
    lctype (func.__call__'s cases)."""
    from luisa import lcapi

    enc = lcapi.ComputeDispatchCmdEncoder
    if lctype.is_basic():
        return enc.encode_uniform, (lcapi.to_bytes(a), lctype.size())
    if lctype.is_array() or lctype.is_structure():
        return enc.encode_uniform, (a.to_bytes(), lctype.size())
    if lctype.is_buffer() or lctype.is_custom_buffer():
        return enc.encode_buffer, (a.handle, 0, a.bytesize)
    if lctype.is_texture():
        return enc.encode_texture, (a.handle, 0)
    if lctype.is_bindless_array():
        return enc.encode_bindless_array, (a.handle,)
    if lctype.is_accel():
        return enc.encode_accel, (a.handle,)
    raise TypeError(f"a kernel argument of LuisaCompute type {lctype} cannot be encoded")


def _same(old, a) -> bool:
    """Whether argument a encodes as `old` did: the same resource object (its handle and size are
    fixed for its life), or a Python scalar of the same type and value (an array or struct, which
    may change in place, is always encoded again)."""
    if type(old) is weakref.ref:
        return old() is a
    return type(old) is type(a) and type(a) in (int, float, bool) and old == a


def _key(a):
    """What `_same` compares a later argument with: a weak reference to a resource (the Launcher
    must not keep a replaced buffer alive), the value of a scalar; None (never the same) for a
    resource that takes no weak reference."""
    if not hasattr(a, "handle"):
        return a
    try:
        return weakref.ref(a)
    except TypeError:
        return None


class Prepared(NamedTuple):
    """One launch ready to enqueue: the compiled shader's argument size, handle and function, the
    tail's encodings, the dispatch size."""

    argument_size: int
    shader: int
    function: object
    tail: tuple
    count: int


class Launcher:
    """Launches of kernels whose leading arguments are `shared` (typed and encoded once here),
    followed by a few of their own (typed per `prepare`: the stage index)."""

    def __init__(self, shared: Sequence) -> None:
        from luisa import lcapi

        self.create = lcapi.ComputeDispatchCmdEncoder.create  # (not imported per launch)
        self.types: tuple = ()
        self.keys: list = []
        self.encodings: list = []
        self.rebind(shared)

    def rebind(self, shared: Sequence) -> bool:
        """Take `shared` as the leading arguments from now on, typing only those that are not the
        arguments already bound; return whether the type tuple changed (Prepared launches made
        before then name shaders compiled for other types)."""
        from luisa.types import dtype_of, to_lctype

        if len(shared) != len(self.keys):
            self.keys, self.encodings, types = [None] * len(shared), [None] * len(shared), [None] * len(shared)
        else:
            types = list(self.types)
        for i, a in enumerate(shared):
            if i < len(types) and types[i] is not None and _same(self.keys[i], a):
                continue
            types[i] = dtype_of(a)
            self.keys[i], self.encodings[i] = _key(a), _encoding(to_lctype(types[i]), a)
        types = tuple(types)
        changed = types != self.types
        self.types = types
        return changed

    def prepare(self, kernel, tail: Sequence, count: int) -> Prepared:
        """The launch kernel(*shared, *tail, dispatch_size=count), its shader compiled if it is not yet."""
        from luisa.types import dtype_of, to_lctype

        tail_types = tuple(dtype_of(a) for a in tail)
        f = kernel.get_compiled(func_type=0, allow_ref=False, argtypes=self.types + tail_types)
        return Prepared(f.function.argument_size(), f.shader_handle, f.function,
                        tuple(_encoding(to_lctype(t), a) for t, a in zip(tail_types, tail)), count)

    def enqueue(self, p: Prepared, add=None) -> None:
        """Enqueue prepared launch p on luisa's stream (add: that stream's `add`, looked up once by a
        caller enqueueing many)."""
        command = self.create(p.argument_size, p.shader, p.function)
        for encode, args in self.encodings:
            encode(command, *args)
        for encode, args in p.tail:
            encode(command, *args)
        command.set_dispatch_size(p.count, 1, 1)
        if add is None:
            from luisa import globalvars

            add = globalvars.vars.stream.add
        add(command.build())

    def __call__(self, kernel, tail: Sequence, count: int) -> None:
        """kernel(*shared, *tail, dispatch_size=count), enqueued on luisa's stream."""
        self.enqueue(self.prepare(kernel, tail, count))
