"""Function expansion: a node whose op type luisaml has no operator for, but whose ONNX schema
defines it as a function of other ops (LinearAttention, CausalConvWithState, ...), is replaced by
that function's body, specialised to the node: its attributes (schema defaults filled in), and,
for a context-dependent function, its input types."""
from __future__ import annotations

import onnx
from onnx import AttributeProto, FunctionProto, GraphProto, NodeProto, TypeProto

MAX_ROUNDS = 8  # a body may hold function ops of its own


def _opsets(proto: onnx.ModelProto) -> dict[str, int]:
    return {("" if o.domain == "ai.onnx" else o.domain): o.version for o in proto.opset_import}


def _schema(node: NodeProto, opsets: dict[str, int]):
    domain = "" if node.domain == "ai.onnx" else node.domain
    if domain not in opsets:
        return None
    try:
        return onnx.defs.get_schema(node.op_type, opsets[domain], domain)
    except Exception:  # not an ONNX op at this opset (a custom domain, a typo): left for the registry
        return None


def _function(schema, node: NodeProto, opset: int, input_types: list[TypeProto]) -> FunctionProto | None:
    """Return the schema's function body for this opset (the newest version not above it)."""
    static = [v for v in schema.function_opset_versions if v <= opset]
    dependent = [v for v in schema.context_dependent_function_opset_versions if v <= opset]
    f = FunctionProto()
    if dependent and (not static or max(dependent) >= max(static)):
        if any(t is None for t in input_types):
            return None  # its body depends on input types onnx could not infer
        f.ParseFromString(schema.get_context_dependent_function_with_opset_version(
            max(dependent), node.SerializeToString(), [t.SerializeToString() for t in input_types]))
        return f
    if static:
        f.ParseFromString(schema.get_function_with_opset_version(max(static)))
        return f
    return None


def rename_node(node: NodeProto, rename, attrs: dict[str, AttributeProto], prefix: str) -> NodeProto:
    """Return a copy of a body node with its edges renamed and attribute references resolved."""
    new = NodeProto()
    new.CopyFrom(node)
    del new.input[:], new.output[:], new.attribute[:]
    new.input.extend(rename(i) for i in node.input)
    new.output.extend(rename(o) for o in node.output)
    if node.name:
        new.name = prefix + node.name
    for a in node.attribute:
        if a.HasField("ref_attr_name"):
            if a.ref_attr_name in attrs:  # an unset optional attribute is left out
                b = AttributeProto()
                b.CopyFrom(attrs[a.ref_attr_name])
                b.name = a.name
                new.attribute.append(b)
            continue
        b = AttributeProto()
        b.CopyFrom(a)
        if a.type == AttributeProto.GRAPH:
            _rename_graph(b.g, rename, attrs, prefix)
        for g in b.graphs:
            _rename_graph(g, rename, attrs, prefix)
        new.attribute.append(b)
    return new


def _rename_graph(g: GraphProto, outer_rename, attrs, prefix: str) -> None:
    """Rename a subgraph of a body in place: its own names get the prefix, outer reads follow the
    enclosing renaming."""
    own = {vi.name for vi in list(g.input) + list(g.output)} | {t.name for t in g.initializer}
    own |= {o for n in g.node for o in n.output}

    def rename(name: str) -> str:
        if not name:
            return name
        return prefix + name if name in own else outer_rename(name)

    for vi in list(g.input) + list(g.output) + list(g.value_info):
        vi.name = rename(vi.name)
    for t in g.initializer:
        t.name = rename(t.name)
    nodes = [rename_node(n, rename, attrs, prefix) for n in g.node]
    del g.node[:]
    g.node.extend(nodes)


def _expand(node: NodeProto, body: FunctionProto, schema, prefix: str) -> list[NodeProto]:
    attrs = {a.name: a for a in node.attribute}
    for name, spec in schema.attributes.items():
        if name not in attrs and spec.default_value is not None and spec.default_value.name:
            attrs[name] = spec.default_value
    names = {f: (node.input[k] if k < len(node.input) else "") for k, f in enumerate(body.input)}
    names.update({f: node.output[k] for k, f in enumerate(body.output) if k < len(node.output) and node.output[k]})

    def rename(name: str) -> str:
        if name in names:
            return names[name]
        return prefix + name if name else name

    return [rename_node(n, rename, attrs, prefix) for n in body.node]


def _types(proto: onnx.ModelProto) -> dict[str, TypeProto]:
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception:
        inferred = proto
    g = inferred.graph
    types = {vi.name: vi.type for vi in list(g.input) + list(g.value_info) + list(g.output)}
    for t in g.initializer:
        types[t.name] = onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims))
    return types


def expand_functions(proto: onnx.ModelProto, implemented) -> int:
    """Expand, in the main graph, every node that `implemented(op_type, domain, opset)` rejects
    and whose schema has a function body at the model's opset; return how many were expanded."""
    total = 0
    for _ in range(MAX_ROUNDS):
        opsets = _opsets(proto)
        types = None
        nodes, count = [], 0
        for k, node in enumerate(proto.graph.node):
            domain = "" if node.domain == "ai.onnx" else node.domain
            schema = None if implemented(node.op_type, domain, opsets.get(domain, 0)) else _schema(node, opsets)
            body = None
            if schema is not None and (schema.has_function or schema.has_context_dependent_function):
                if types is None:
                    types = _types(proto)
                # an absent optional input has an empty type; a present one must be typed
                body = _function(schema, node, opsets[domain],
                                 [types.get(i) if i else TypeProto() for i in node.input])
            if body is None:
                nodes.append(node)
                continue
            for o in body.opset_import:
                d = "" if o.domain == "ai.onnx" else o.domain
                if d not in opsets:
                    proto.opset_import.append(onnx.helper.make_opsetid(o.domain, o.version))
                    opsets[d] = o.version
            nodes.extend(_expand(node, body, schema, f"{node.name or node.op_type}__f{total + count}__"))
            count += 1
        if not count:
            break
        del proto.graph.node[:]
        proto.graph.node.extend(nodes)
        total += count
    return total
