"""Validation of a ModelProto before any other pass touches it: names that are UTF-8 text,
versions the installed onnx knows, a graph that is a DAG where every tensor has one producer,
tensors whose data fits their dims, nodes whose input and output counts and attribute types their
schema allows, recursively inside subgraphs.

It runs first in `prepare` rather than in the loaders: every compile path (runtime.analyze, the
CLI, the ONNX backend, a ModelProto handed straight to `prepare`) passes through `prepare`, while a
caller that builds its own proto skips the loaders; and the later passes (opset conversion, shape
inference, folding, the compiler) all assume what is checked here. A self-loop `Add(x, s) -> s`
would otherwise compile into a kernel that reads last call's value of `s`, and a Relu with two
inputs would fail inside its operator with a TypeError.

onnx.checker.check_model is not the gate: it refuses models luisaml compiles and runs correctly
(graph outputs declared without a shape, GroupNormalization-18 which onnx marks deprecated), and
its messages would replace luisaml's (an unknown op: luisaml's names every such node). What it
checks that matters here (single assignment, acyclicity, arity, attribute types, tensor data against
dims) is checked below, with onnx's schemas where they apply."""
from __future__ import annotations

import math

import onnx
import onnx.defs
from google.protobuf.message import Message

from .. import dtypes
from ..errors import CompileError, ModelError
from ..limits import DEFAULT, Limits
from ..model import check_tensor


def onnx_domains() -> dict[str, int]:
    """Return the newest opset version of each operator domain the installed onnx ships ('' for ai.onnx)."""
    # schema_version_map also lists domains registered at run time (luisaml's fvdb, a user's);
    # only onnx's own have a newest version that a model may not exceed
    return {d: hi for d, (_, hi) in onnx.defs.C.schema_version_map().items() if d == "" or d.startswith("ai.onnx")}


def check_versions(proto: onnx.ModelProto) -> None:
    """Raise ModelError if the model's IR version or an opset of an onnx domain is newer than the
    installed onnx knows (its operators' meaning would be guessed), or if a domain is imported twice."""
    if proto.ir_version > onnx.IR_VERSION:
        raise ModelError(
            f"the model has IR version {proto.ir_version}, newer than the installed onnx {onnx.__version__} "
            f"supports (IR version {onnx.IR_VERSION}); upgrade onnx, or export the model for an older IR version"
        )
    known = onnx_domains()
    imports = [("the model", proto.opset_import)] + [(f"function '{f.domain}::{f.name}'", f.opset_import)
                                                      for f in proto.functions]
    for where, opset_import in imports:
        seen: dict[str, int] = {}
        for o in opset_import:
            domain = "" if o.domain == "ai.onnx" else o.domain
            shown = o.domain or "ai.onnx"
            if domain in seen and seen[domain] != o.version:
                raise ModelError(f"{where} imports domain '{shown}' twice, at opset {seen[domain]} and {o.version}")
            seen[domain] = o.version
            if domain not in known:
                continue  # a custom domain (fvdb, a user's): its registry entry decides
            if o.version < 1:
                raise ModelError(f"{where} imports domain '{shown}' at opset {o.version}; opsets start at 1")
            if o.version > known[domain]:
                raise ModelError(
                    f"{where} imports domain '{shown}' at opset {o.version}, newer than the installed onnx "
                    f"{onnx.__version__} knows (up to opset {known[domain]}); upgrade onnx, or export the model "
                    f"for opset {known[domain]} or older"
                )


def validate_model(proto: onnx.ModelProto, *, limits: Limits = DEFAULT) -> None:
    """Raise ModelError or CompileError, naming the offender, for a model luisaml must not compile;
    LimitError for a graph input whose static dims exceed what a kernel can index. A graph output
    listed twice with one type is listed once after it (drop_repeated_outputs)."""
    check_text(proto)
    check_versions(proto)
    g = proto.graph
    if not g.output:
        what = "no nodes and no outputs" if not g.node else f"{len(g.node)} nodes but no outputs"
        raise ModelError(f"graph '{g.name}' has {what}: there is nothing to compute")
    drop_repeated_outputs(proto)
    for vi in g.input:
        dims = vi.type.tensor_type.shape.dim if vi.type.HasField("tensor_type") else []
        static = [d.dim_value for d in dims if d.HasField("dim_value") and d.dim_value > 0]
        limits.check_elements(f"graph input '{vi.name}' (its static dims {static})", math.prod(static),
                              _itemsize(vi.type.tensor_type.elem_type))
    opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in proto.opset_import}
    _check_graph(g, frozenset(), opsets, onnx_domains())


def drop_repeated_outputs(proto: onnx.ModelProto) -> None:
    """Remove the repeats of a top-level graph output listed twice with the same type (onnxruntime runs
    such a model and answers it twice; luisaml's outputs are by name, so once); a repeat declared with
    another type is a ModelError naming it. Subgraph outputs are positional and left alone."""
    g = proto.graph
    first: dict[str, onnx.ValueInfoProto] = {}
    keep = []
    for vi in g.output:
        seen = first.get(vi.name)
        if seen is None:
            first[vi.name] = vi
            keep.append(vi)
        elif seen.type != vi.type:
            raise ModelError(f"graph '{g.name}': output '{vi.name}' is listed twice with different types "
                             f"({_type_str(seen)} and {_type_str(vi)}); list it once")
    if len(keep) != len(g.output):
        kept = [onnx.ValueInfoProto.FromString(vi.SerializeToString()) for vi in keep]
        del g.output[:]
        g.output.extend(kept)


def _type_str(vi: onnx.ValueInfoProto) -> str:
    tt = vi.type.tensor_type
    if not vi.type.HasField("tensor_type"):
        return "not a tensor"
    dims = [d.dim_param or (d.dim_value if d.HasField("dim_value") else "?") for d in tt.shape.dim]
    return f"{onnx.TensorProto.DataType.Name(tt.elem_type) if tt.elem_type else 'no element type'} {dims}"


def check_text(proto: onnx.ModelProto) -> None:
    """Raise ModelError naming the field of a name (op type, domain, tensor or graph name, ...)
    that is not valid UTF-8: protobuf hands such a string over as bytes, which every later step
    would trip on."""
    stack: list[tuple[Message, str]] = [(proto, "model")]
    while stack:
        msg, path = stack.pop()
        for fd, value in msg.ListFields():
            if fd.name in ("doc_string", "metadata_props"):
                continue  # free text no step reads
            here = f"{path}.{fd.name}"
            repeated = fd.is_repeated
            if fd.type == fd.TYPE_STRING:
                items = list(value) if repeated else [value]
                for k, v in enumerate(items):
                    if isinstance(v, bytes):
                        at = f"{here}[{k}]" if repeated else here
                        raise ModelError(f"{_where(at, msg)}: {fd.name} {v!r} is not valid UTF-8 text")
            elif fd.type == fd.TYPE_MESSAGE:
                items = list(value) if repeated else [value]
                for k, v in enumerate(items):
                    stack.append((v, f"{here}[{k}]" if repeated else here))


def _where(path: str, msg: Message) -> str:
    """Return a field path, with the node's or tensor's name where it has a readable one."""
    name = getattr(msg, "name", "")
    return f"{path} ('{name}')" if isinstance(name, str) and name else path


def _itemsize(elem_type: int) -> int:
    dt = dtypes.SUPPORTED.get(elem_type)
    return dt.numpy.itemsize if dt is not None else 1


def _node_name(n: onnx.NodeProto, k: int) -> str:
    """Return how messages name node k: its name, or OpType_k as the model loader names it."""
    return n.name or f"{n.op_type}_{k}"


def _describe(n: onnx.NodeProto, k: int) -> str:
    op = f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
    return f"node '{_node_name(n, k)}' ({op})"


def _subgraphs(n: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [g for a in n.attribute for g in ([a.g] if a.HasField("g") else []) + list(a.graphs)]


def _outer_reads(g: onnx.GraphProto) -> set[str]:
    """Return the names g (and its subgraphs) read from enclosing scopes."""
    local = {i.name for i in g.input} | {t.name for t in g.initializer} | {o for n in g.node for o in n.output}
    reads = {i for n in g.node for i in n.input if i} | {o.name for o in g.output}
    for n in g.node:
        for sub in _subgraphs(n):
            reads |= _outer_reads(sub)
    return reads - local


def _check_graph(g: onnx.GraphProto, outer: frozenset[str], opsets: dict[str, int], known: dict[str, int]) -> None:
    where = f"graph '{g.name}'"
    inputs: set[str] = set()
    for vi in g.input:
        if vi.name in inputs:
            raise ModelError(f"{where}: two graph inputs are named '{vi.name}'")
        inputs.add(vi.name)
    inits: set[str] = set()
    for t in g.initializer:
        if t.name in inits:
            raise ModelError(f"{where}: two initializers are named '{t.name}'")
        inits.add(t.name)
        check_tensor(t, f"{where} initializer")
    producer: dict[str, int] = {}
    for k, n in enumerate(g.node):
        for o in n.output:
            if not o:
                continue
            if o in producer:
                other = g.node[producer[o]]
                raise ModelError(
                    f"{where}: tensor '{o}' is written by {_describe(other, producer[o])} and by {_describe(n, k)}; "
                    "every tensor must have one producer"
                )
            if o in inputs or o in inits:
                kind = "graph input" if o in inputs else "initializer"
                raise ModelError(f"{where}: {_describe(n, k)} writes '{o}', which is a {kind}; every tensor must have one producer")
            producer[o] = k
    defined = outer | inputs | inits | set(producer) | {""}
    for o in g.output:
        if o.name not in defined:
            raise ModelError(f"{where}: graph output '{o.name}' is no graph input, initializer or node output")
    deps: list[set[str]] = []
    for k, n in enumerate(g.node):
        for a in n.attribute:
            for t in ([a.t] if a.HasField("t") else []) + list(a.tensors):
                check_tensor(t, f"{where}: {_describe(n, k)} attribute '{a.name}' tensor")
        _check_schema(n, k, opsets, known)
        reads = {i for i in n.input if i}
        for sub in _subgraphs(n):
            reads |= _outer_reads(sub)
        deps.append({r for r in reads if r in producer})
        for sub in _subgraphs(n):
            _check_graph(sub, frozenset(defined), opsets, known)
    _check_acyclic(g, deps, producer)


def _check_acyclic(g: onnx.GraphProto, deps: list[set[str]], producer: dict[str, int]) -> None:
    """Raise ModelError naming a cycle of nodes (a node reading its own output included)."""
    for k, n in enumerate(g.node):
        own = deps[k] & {o for o in n.output if o}
        if own:
            raise ModelError(
                f"graph '{g.name}': {_describe(n, k)} reads its own output '{sorted(own)[0]}'; the graph must be "
                "acyclic (a tensor cannot carry a value from one run to the next)"
            )
    waiting = [len({producer[d] for d in ds}) for ds in deps]
    users: dict[int, list[int]] = {}
    for k, ds in enumerate(deps):
        for p in {producer[d] for d in ds}:
            users.setdefault(p, []).append(k)
    ready = [k for k, w in enumerate(waiting) if w == 0]
    done = 0
    while ready:
        k = ready.pop()
        done += 1
        for u in users.get(k, []):
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.append(u)
    if done == len(g.node):
        return
    # every node left waits on another node left: follow producers until one repeats
    k, path = next(k for k, w in enumerate(waiting) if w > 0), []
    while k not in path:
        path.append(k)
        k = next(producer[d] for d in sorted(deps[k]) if waiting[producer[d]] > 0)
    cycle = path[path.index(k):] + [k]
    raise ModelError(
        f"graph '{g.name}' has a cycle: " + " -> ".join(_describe(g.node[j], j) for j in cycle)
        + "; the graph must be acyclic"
    )


def _check_schema(n: onnx.NodeProto, k: int, opsets: dict[str, int], known: dict[str, int]) -> None:
    """Raise CompileError if a node of an onnx domain has more or fewer inputs or outputs than its
    schema allows, leaves a required input empty, or gives an attribute of the wrong type."""
    domain = "" if n.domain == "ai.onnx" else n.domain
    if domain not in known or opsets.get(domain, 0) < 1:
        return
    try:
        schema = onnx.defs.get_schema(n.op_type, opsets[domain], domain)
    except onnx.defs.SchemaError:
        return  # an op onnx does not have at this opset: the registry reports it as unsupported
    for what, count, lo, hi in (("inputs", len(n.input), schema.min_input, schema.max_input),
                                ("outputs", len(n.output), schema.min_output, schema.max_output)):
        if not lo <= count <= hi:
            allowed = f"{lo}" if lo == hi else f"{lo} or more" if hi >= 2**31 - 1 else f"{lo} to {hi}"
            raise CompileError(
                f"{_describe(n, k)} has {count} {what}, but {n.op_type}-{schema.since_version} takes {allowed}"
            )
    formal = schema.inputs
    single = onnx.defs.OpSchema.FormalParameterOption.Single
    for i, name in enumerate(n.input):
        p = formal[min(i, len(formal) - 1)] if formal else None
        if not name and p is not None and p.option == single and i < len(formal):
            raise CompileError(f"{_describe(n, k)} input #{i} ('{p.name}') is required but empty")
    for a in n.attribute:
        spec = schema.attributes.get(a.name)
        # type 0 (UNDEFINED): written by old exporters, the value decides
        if spec is not None and a.type and a.type != int(spec.type):
            got = onnx.AttributeProto.AttributeType.Name(a.type) if a.type in _ATTR_TYPES else str(a.type)
            raise CompileError(
                f"{_describe(n, k)} attribute '{a.name}' is {got}, but {n.op_type}-{schema.since_version} "
                f"takes {onnx.AttributeProto.AttributeType.Name(int(spec.type))}"
            )


_ATTR_TYPES = frozenset(onnx.AttributeProto.AttributeType.values())
