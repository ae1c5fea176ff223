"""Hostile or broken input files: each gives a luisaml error of the right class whose message
names the offender (file, node, tensor, field) — never a wrong answer, a crash or a generic
traceback."""
import json
import struct

import numpy as np
import onnx
import onnx.defs
import pytest
from onnx import TensorProto, helper, numpy_helper

import luisaml
from luisaml import compiler
from luisaml.errors import CompileError, LimitError, ModelError, WeightsError
from luisaml.limits import INDEX_LIMIT, Limits
from luisaml.loaders import load_proto, to_json_model
from luisaml.loaders.weights import parse_safetensors
from luisaml.passes.fold import fold_to_fixpoint
from luisaml.passes.infer import infer_shapes
from luisaml.passes.validate import check_versions, validate_model


def _mlp(seed=0, opset=17) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    w1, b1 = rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    w2, b2 = rng.standard_normal((3, 6)).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1, name="fc1"),
             helper.make_node("Relu", ["h"], ["r"], name="act"),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], transB=1, name="fc2")]
    g = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(a, n) for n, a in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2))])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _weights(proto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}


def _graph(nodes, inputs, outputs, inits=(), name="g", opset=17) -> onnx.ModelProto:
    g = helper.make_graph(nodes, name, inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def _safetensors(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _split(raw: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


@pytest.fixture
def json_safetensors(tmp_path):
    """A LuisaML JSON model of the MLP whose weights are a real safetensors file."""
    proto = _mlp()
    doc, raw = to_json_model(proto, "safetensors")
    mp = tmp_path / "m.json"
    mp.write_text(json.dumps(doc))
    return proto, doc, raw, mp


# ---- weights files ---------------------------------------------------------------------------


def test_valid_safetensors_read_like_the_reference_library():
    """Files the safetensors library writes (every numpy dtype, empty tensors, metadata) parse,
    and their tensors equal what was saved."""
    from safetensors.numpy import load, save

    rng = np.random.default_rng(0)
    arrays = {"f32": rng.standard_normal((3, 4)).astype(np.float32), "f16": rng.standard_normal(5).astype(np.float16),
              "i64": rng.integers(-9, 9, (2, 2)), "u8": rng.integers(0, 255, 7).astype(np.uint8),
              "b": rng.random(3) > 0.5, "empty": np.zeros((0, 3), np.float32), "scalar": np.array(2.5, np.float64)}
    raw = save(arrays, metadata={"format": "np"})
    src = luisaml.loaders.read_weights(raw)
    assert src.is_safetensors
    reference = load(raw)
    assert sorted(src.tensors) == sorted(reference)
    for k, v in reference.items():
        assert src.tensors[k].dtype == v.dtype and src.tensors[k].shape == v.shape
        np.testing.assert_array_equal(src.tensors[k], v)


def test_corrupted_safetensors_header_byte_is_an_error_not_a_blob(tmp_path, json_safetensors):
    """One flipped header byte used to turn the file into a 'blob' read from the wrong offsets."""
    _, _, raw, mp = json_safetensors
    n = struct.unpack("<Q", raw[:8])[0]
    for pos in (9, 8 + n // 2, 8 + n - 2):
        bad = bytearray(raw)
        bad[pos] ^= 0x55
        wp = tmp_path / "bad.safetensors"
        wp.write_bytes(bytes(bad))
        try:
            parse_safetensors(bytes(bad))
        except ValueError:
            pass
        else:
            continue  # this flip left a valid file (a digit of an offset, say): covered below
        with pytest.raises(WeightsError, match=r"weights file '.*bad\.safetensors': invalid safetensors file: "):
            load_proto(mp, wp)


def test_corrupted_safetensors_header_with_protobuf_model(tmp_path):
    proto = _mlp()
    bare = onnx.ModelProto()
    bare.CopyFrom(proto)
    for t in bare.graph.initializer:
        t.ClearField("raw_data")
        t.ClearField("float_data")
    from safetensors.numpy import save

    raw = bytearray(save(_weights(proto)))
    raw[12] = ord("#")
    with pytest.raises(WeightsError, match=r"weight bytes: invalid safetensors file: its \d+-byte header is not valid JSON"):
        load_proto(bare, bytes(raw))


def _edit(raw: bytes, change) -> bytes:
    header, data = _split(raw)
    data = change(header, data)
    return _safetensors(header, data)


def _first(header):
    return sorted(k for k in header if k != "__metadata__")[0]


SAFETENSORS_BREAKS = {
    "unknown dtype": (lambda h, d: (h[_first(h)].update(dtype="F33"), d)[1], r"tensor 'b1' has dtype 'F33'"),
    "shape and span differ": (lambda h, d: (h[_first(h)].update(shape=[7]), d)[1],
                              r"tensor 'b1' is F32\[7\], 28 bytes, but its data_offsets \[\d+, \d+\] span 24"),
    "offsets past the end": (lambda h, d: d[:-4], r"tensor '\w+' data_offsets \[\d+, \d+\] reach past the data section"),
    "overlap": (lambda h, d: (h["b2"].update(data_offsets=[0, 12]), d)[1], r"overlap tensor"),
    "hole": (lambda h, d: d[:0] + d, None),
    "trailing bytes": (lambda h, d: d + b"\0" * 8, r"data section bytes \[\d+, \d+\) belong to no tensor"),
    "negative dim": (lambda h, d: (h[_first(h)].update(shape=[-6]), d)[1], r"tensor 'b1' has shape \[-6\]"),
    "bad metadata": (lambda h, d: (h.update(__metadata__={"a": 1}), d)[1], r"__metadata__ must map strings"),
}


@pytest.mark.parametrize("case", sorted(SAFETENSORS_BREAKS))
def test_invalid_safetensors_named(tmp_path, json_safetensors, case):
    _, _, raw, mp = json_safetensors
    change, message = SAFETENSORS_BREAKS[case]
    if case == "hole":  # move every tensor after the first 8 bytes, leaving [0, 8) unindexed
        header, data = _split(raw)
        for k in header:
            if k != "__metadata__":
                header[k]["data_offsets"] = [o + 8 for o in header[k]["data_offsets"]]
        bad, message = _safetensors(header, b"\0" * 8 + data), r"data section bytes \[0, 8\) belong to no tensor"
    else:
        bad = _edit(raw, change)
    with pytest.raises(ValueError, match=message):
        parse_safetensors(bad)
    wp = tmp_path / "w.safetensors"
    wp.write_bytes(bad)
    with pytest.raises(WeightsError, match=r"w\.safetensors': invalid safetensors file: .*" + message):
        load_proto(mp, wp)


def test_duplicate_safetensors_key():
    raw = b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}'
    with pytest.raises(ValueError, match="key 'a' appears twice"):
        parse_safetensors(struct.pack("<Q", len(raw)) + raw + b"\0")


def test_blob_that_fits_nothing_names_the_file(tmp_path, json_safetensors):
    _, doc, _, _ = json_safetensors
    wp = tmp_path / "w.bin"
    wp.write_bytes(b"\x07" * 1000)
    mp = tmp_path / "blob.json"
    blob_doc, blob = to_json_model(_mlp(), "blob")
    mp.write_text(json.dumps(blob_doc))
    with pytest.raises(WeightsError, match=r"weights file '.*w\.bin' is neither a safetensors file \(.*\) nor a "
                                           r"header-less blob of exactly the model's weights: it has 1000 bytes, but"):
        load_proto(mp, wp)
    wp.write_bytes(blob + b"\0" * 4)  # the right blob plus four stray bytes
    with pytest.raises(WeightsError, match=r"it has \d+ bytes, but the model's data_offsets end at byte \d+"):
        load_proto(mp, wp)
    wp.write_bytes(blob)
    y = luisaml.compile(mp, wp).run({"x": np.ones((2, 4), np.float32)})["y"]
    from util import ort_run

    np.testing.assert_allclose(y, ort_run(_mlp(), {"x": np.ones((2, 4), np.float32)})["y"], rtol=1e-5, atol=1e-6)


def test_protobuf_blob_must_fit_exactly(tmp_path):
    proto = _mlp()
    for t in proto.graph.initializer:
        t.ClearField("raw_data")
        t.ClearField("float_data")
    blob = b"".join(np.ascontiguousarray(v).tobytes() for _, v in sorted(_weights(_mlp()).items()))
    with pytest.raises(WeightsError, match=r"weight bytes is neither a safetensors file .* it has \d+ bytes, but "
                                           r"the model's 4 initializers without data take \d+"):
        load_proto(proto, blob + b"\0" * 4)
    with pytest.raises(WeightsError, match=r"initializer 'w2' float\[3, 6\]: needs bytes"):
        load_proto(proto, blob[:-8])
    loaded = load_proto(proto, blob)
    for t in loaded.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(t), _weights(_mlp())[t.name])


def test_overlapping_json_offsets_refused(tmp_path):
    doc, blob = to_json_model(_mlp(), "blob")
    inits = {i["name"]: i for i in doc["graph"]["initializer"]}
    # b2 (3 floats) moved to read the first bytes of b1: same size, inside the blob
    inits["b2"]["data_offsets"] = [inits["b1"]["data_offsets"][0], inits["b1"]["data_offsets"][0] + 12]
    mp, wp = tmp_path / "m.json", tmp_path / "w.bin"
    mp.write_text(json.dumps(doc))
    wp.write_bytes(blob)
    with pytest.raises(WeightsError, match=r"initializer '(b1|b2)' bytes \[\d+, \d+\) overlap initializer '(b1|b2)'"):
        load_proto(mp, wp)


def test_tensor_missing_from_safetensors_names_it(tmp_path, json_safetensors):
    """The JSON model's offsets must not be used to read a missing tensor from other tensors' bytes."""
    from safetensors.numpy import save

    proto, _, _, mp = json_safetensors
    w = _weights(proto)
    w["w2_renamed"] = w.pop("w2")
    wp = tmp_path / "w.safetensors"
    wp.write_bytes(save(w))
    with pytest.raises(WeightsError, match=r"initializer 'w2': weights file '.*w\.safetensors' has no tensor of that name"):
        load_proto(mp, wp)
    bare = onnx.ModelProto()
    bare.CopyFrom(proto)
    for t in bare.graph.initializer:
        t.ClearField("raw_data")
        t.ClearField("float_data")
    with pytest.raises(WeightsError, match=r"'w2': weights file .* has no tensor of that name"):
        load_proto(bare, wp)
    wp.write_bytes(save({}, metadata={"empty": "yes"}))  # a valid file without tensors
    with pytest.raises(WeightsError, match=r"initializer '\w+': weights file .* has no tensor of that name"):
        load_proto(mp, wp)


def test_unreadable_safetensors_dtype_named(tmp_path, json_safetensors):
    _, _, raw, mp = json_safetensors

    def to_bf16(h, d):
        h["w1"]["dtype"] = "BF16"
        h["w1"]["shape"] = [2 * h["w1"]["shape"][0], h["w1"]["shape"][1]]
        return d

    wp = tmp_path / "w.safetensors"
    wp.write_bytes(_edit(raw, to_bf16))
    with pytest.raises(WeightsError, match=r"initializer 'w1': weights file .* holds it as BF16"):
        load_proto(mp, wp)


def test_every_dtype_the_library_reads_is_valid(tmp_path, json_safetensors):
    """A file the safetensors library accepts, in a dtype numpy has no type for (F8_E4M3FNUZ), is a
    valid safetensors file whose tensor luisaml names as unreadable, not a blob that fits nothing."""
    import safetensors

    _, _, raw, mp = json_safetensors

    def to_fnuz(h, d):
        h["w1"]["dtype"] = "F8_E4M3FNUZ"
        h["w1"]["shape"] = [4 * h["w1"]["shape"][0], h["w1"]["shape"][1]]
        return d

    bad = _edit(raw, to_fnuz)
    assert dict(safetensors.deserialize(bad))["w1"]["dtype"] == "F8_E4M3FNUZ"
    wp = tmp_path / "w.safetensors"
    wp.write_bytes(bad)
    with pytest.raises(WeightsError, match=r"initializer 'w1': weights file .* holds it as F8_E4M3FNUZ"):
        load_proto(mp, wp)


def test_weight_as_graph_input_of_wrong_shape(tmp_path):
    proto = _mlp()
    w = _weights(proto)
    bare = onnx.ModelProto()
    bare.CopyFrom(proto)
    del bare.graph.initializer[:]
    for k, v in w.items():
        bare.graph.input.append(_vi(k, list(v.shape)))
    w["w1"] = np.zeros((4, 6), np.float32)
    with pytest.raises(WeightsError, match=r"graph input 'w1': weights dict holds float32\[4, 6\], expected \[6, 4\]"):
        load_proto(bare, w)


def test_empty_weights_file(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"")
    with pytest.raises(WeightsError, match=r"weights file '.*w\.bin' is empty"):
        load_proto(_mlp(), tmp_path / "w.bin")


def test_weights_file_over_the_limit(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"\0" * 1500)
    with pytest.raises(LimitError, match=r"weights file '.*w\.bin' needs 1\.\d KiB, more than .*weight_bytes"):
        load_proto(_mlp(), tmp_path / "w.bin", limits=Limits(weight_bytes=1000))


# ---- model files -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["m.onnx", "m.json"])
def test_empty_model_file(tmp_path, name):
    (tmp_path / name).write_bytes(b"")
    with pytest.raises(ModelError, match=rf"model file '.*{name}' is empty \(0 bytes\)"):
        load_proto(tmp_path / name)


def test_onnx_file_without_graph(tmp_path):
    (tmp_path / "m.onnx").write_bytes(onnx.ModelProto(ir_version=8).SerializeToString())
    with pytest.raises(ModelError, match=r"model file '.*m\.onnx' holds no ONNX graph"):
        load_proto(tmp_path / "m.onnx")


@pytest.mark.parametrize("domain", ["", "ai.onnx", "ai.onnx.ml"])
def test_opset_newer_than_onnx_knows(tmp_path, domain):
    newest = onnx.defs.C.schema_version_map()["" if domain == "ai.onnx" else domain][1]
    proto = _mlp()
    if domain == "ai.onnx.ml":
        proto.opset_import.append(helper.make_opsetid(domain, newest + 1))
    else:
        proto.opset_import[0].domain = domain
        proto.opset_import[0].version = newest + 1
    onnx.save(proto, tmp_path / "m.onnx")
    shown = domain or "ai.onnx"
    with pytest.raises(ModelError, match=rf"imports domain '{shown}' at opset {newest + 1}, newer than the installed "
                                         rf"onnx {onnx.__version__} knows \(up to opset {newest}\)"):
        luisaml.compile(tmp_path / "m.onnx")
    proto.opset_import[-1].version = newest  # the newest onnx knows passes the version check
    check_versions(proto)


def test_ir_version_newer_than_onnx_knows():
    proto = _mlp()
    proto.ir_version = onnx.IR_VERSION + 1
    with pytest.raises(ModelError, match=rf"IR version {onnx.IR_VERSION + 1}, newer than the installed onnx "
                                         rf"{onnx.__version__} supports \(IR version {onnx.IR_VERSION}\)"):
        compiler.prepare(proto)


def test_custom_domains_keep_any_version():
    """luisaml's fvdb and a user's domain are not onnx's to version."""
    proto = _mlp()
    proto.opset_import.extend([helper.make_opsetid("fvdb", 1), helper.make_opsetid("my.company", 4000)])
    check_versions(proto)
    proto.opset_import.append(helper.make_opsetid("my.company", 3))
    with pytest.raises(ModelError, match="imports domain 'my.company' twice, at opset 4000 and 3"):
        check_versions(proto)


# ---- graph structure -------------------------------------------------------------------------


def _checker_rejects(model) -> bool:
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError:
        return True
    return False


def test_self_loop_refused():
    """Add(x, s) -> s used to compile into a kernel that accumulates across calls."""
    m = _graph([helper.make_node("Add", ["x", "s"], ["s"], name="acc"), helper.make_node("Relu", ["s"], ["y"], name="r")],
               [_vi("x", [1, 4])], [_vi("y", [1, 4])])
    assert _checker_rejects(m)
    with pytest.raises(ModelError, match=r"node 'acc' \(Add\) reads its own output 's'; the graph must be acyclic"):
        luisaml.compile(m, batch_axis=None)


def test_cycle_refused_naming_its_nodes():
    m = _graph([helper.make_node("Add", ["x", "b"], ["a"], name="na"), helper.make_node("Neg", ["a"], ["b"], name="nb"),
                helper.make_node("Relu", ["b"], ["y"], name="nr")], [_vi("x", [2])], [_vi("y", [2])])
    assert _checker_rejects(m)
    with pytest.raises(ModelError, match=r"has a cycle: node '(na|nb)' .* -> node '(na|nb)' .* -> node '(na|nb)'"):
        validate_model(m)
    with pytest.raises(ModelError, match=r"cycle.*node '(na|nb)'"):
        luisaml.compile(m, batch_axis=None)


@pytest.mark.parametrize("case", ["two nodes", "graph input", "initializer"])
def test_tensor_with_two_producers(case):
    one = numpy_helper.from_array(np.ones(2, np.float32), "c")
    if case == "two nodes":
        nodes, message = [helper.make_node("Relu", ["x"], ["y"], name="p1"), helper.make_node("Neg", ["x"], ["y"], name="p2")], \
            r"tensor 'y' is written by node 'p1' \(Relu\) and by node 'p2' \(Neg\)"
    elif case == "graph input":
        nodes, message = [helper.make_node("Relu", ["x"], ["x"], name="p"), helper.make_node("Neg", ["x"], ["y"])], \
            r"node 'p' \(Relu\) writes 'x', which is a graph input"
    else:
        nodes, message = [helper.make_node("Relu", ["x"], ["c"], name="p"), helper.make_node("Add", ["x", "c"], ["y"])], \
            r"node 'p' \(Relu\) writes 'c', which is a initializer"
    m = _graph(nodes, [_vi("x", [2])], [_vi("y", [2])], [one])
    assert _checker_rejects(m)
    with pytest.raises(ModelError, match=message):
        luisaml.compile(m, batch_axis=None)


def test_cycle_inside_a_subgraph():
    body = helper.make_graph([helper.make_node("Add", ["x", "t"], ["t"], name="inner")], "then_body", [], [_vi("t", [2])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["u"])], "else_body", [], [_vi("u", [2])])
    m = _graph([helper.make_node("If", ["c"], ["y"], then_branch=body, else_branch=other, name="branch")],
               [_vi("c", [], TensorProto.BOOL), _vi("x", [2])], [_vi("y", [2])])
    with pytest.raises(ModelError, match=r"graph 'then_body': node 'inner' \(Add\) reads its own output 't'"):
        luisaml.compile(m, batch_axis=None)


def test_empty_model_refused_passthrough_kept():
    empty = _graph([], [_vi("x", [2])], [])
    assert not _checker_rejects(empty)  # onnx accepts it; there is nothing to compile
    with pytest.raises(ModelError, match=r"graph 'g' has no nodes and no outputs"):
        luisaml.compile(empty, batch_axis=None)
    passthrough = _graph([], [_vi("x", [2])], [_vi("x", [2])])
    assert not _checker_rejects(passthrough)
    prepared = compiler.prepare(passthrough, batch_axis=None)
    assert prepared.model.graph.outputs == prepared.model.graph.inputs == ["x"]


def test_undefined_graph_output():
    m = _graph([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", [2])], [_vi("z", [2])])
    with pytest.raises(ModelError, match=r"graph output 'z' is no graph input, initializer or node output"):
        compiler.prepare(m, batch_axis=None)


@pytest.mark.parametrize("op, inputs, outputs", [
    ("Relu", ["x", "x"], ["y"]),
    ("Relu", ["x"], ["y", "z"]),
    ("Gemm", ["x"], ["y"]),
    ("Add", ["x", "x", "x"], ["y"]),
    ("Concat", [], ["y"]),
])
def test_node_arity_against_the_schema(op, inputs, outputs):
    schema = onnx.defs.get_schema(op, 17, "")
    kw = {"axis": 0} if op == "Concat" else {}
    m = _graph([helper.make_node(op, inputs, outputs, name="bad", **kw)], [_vi("x", [2, 2])], [_vi("y", [2, 2])])
    for o in outputs[1:]:
        m.graph.output.append(_vi(o, [2, 2]))
    what, count, lo, hi = (("inputs", len(inputs), schema.min_input, schema.max_input)
                           if not schema.min_input <= len(inputs) <= schema.max_input
                           else ("outputs", len(outputs), schema.min_output, schema.max_output))
    allowed = str(lo) if lo == hi else f"{lo} or more" if hi >= 2**31 - 1 else f"{lo} to {hi}"
    with pytest.raises(CompileError, match=rf"node 'bad' \({op}\) has {count} {what}, but {op}-{schema.since_version} "
                                           rf"takes {allowed}"):
        luisaml.compile(m, batch_axis=None)


def test_required_input_left_empty():
    m = _graph([helper.make_node("Add", ["", "x"], ["y"], name="bad")], [_vi("x", [2])], [_vi("y", [2])])
    with pytest.raises(CompileError, match=r"node 'bad' \(Add\) input #0 \('A'\) is required but empty"):
        compiler.prepare(m, batch_axis=None)


# ---- LuisaML JSON shapes ---------------------------------------------------------------------


@pytest.mark.parametrize("depth", [150, 100_000])
def test_deeply_nested_json(tmp_path, depth):
    mp = tmp_path / "deep.json"
    mp.write_text('{"graph": {"node": ' + "[" * depth + "]" * depth + "}}")
    with pytest.raises(LimitError, match=r"model file '.*deep\.json': objects and lists nest deeper than 100 levels"):
        load_proto(mp)
    shallow = tmp_path / "ok.json"
    shallow.write_text('{"graph": {"node": ' + "[" * 20 + "]" * 20 + "}}")
    with pytest.raises(ModelError, match=r"graph\.node\[0\]: expected an object, got a list"):  # past the depth check
        load_proto(shallow, limits=Limits(json_depth=30))


def _worked():
    doc, blob = to_json_model(_mlp(), "blob")
    return doc, blob


JSON_BREAKS = {
    "initializer not a list": (lambda d: d["graph"].update(initializer={"a": 1}), r"graph\.initializer: expected a list, got an object"),
    "initializer item": (lambda d: d["graph"]["initializer"].append(7), r"graph\.initializer\[4\]: expected an object, got a number"),
    "node item": (lambda d: d["graph"]["node"].append("Relu"), r"graph\.node\[3\]: expected an object, got a string"),
    "attribute list": (lambda d: d["graph"]["node"][0].update(attribute={}), r"graph\.node\[0\]\.attribute: expected a list"),
    "subgraph": (lambda d: d["graph"]["node"][0]["attribute"].append({"name": "g", "type": "GRAPH", "g": [1]}),
                 r"graph\.node\[0\]\.attribute\[1\]\.g: expected an object, got a list"),
    "offsets not a pair": (lambda d: d["graph"]["initializer"][0].update(data_offsets=[0]),
                           r"graph\.initializer\[0\] \('w1'\) data_offsets: expected \[start, end\]"),
    "offset negative": (lambda d: d["graph"]["initializer"][0].update(data_offsets=[-4, 20]),
                        r"data_offsets\[0\]: expected a non-negative integer, got a number \(-4\)"),
    "offset float": (lambda d: d["graph"]["initializer"][0].update(data_offsets=[0, 2.5]),
                     r"data_offsets\[1\]: expected a non-negative integer, got a number \(2\.5\)"),
    "offsets reversed": (lambda d: d["graph"]["initializer"][0].update(data_offsets=[24, 0]), r"is not a valid range"),
    "name not a string": (lambda d: d["graph"]["initializer"][0].update(name=5), r"graph\.initializer\[0\]\.name: expected a string"),
    "unknown element type": (lambda d: d["graph"]["initializer"][0].update(data_type="FLOAT99"), r"unknown element type 'FLOAT99'"),
    "unknown field": (lambda d: d["graph"]["node"][0].update(colour="red"), r"not a valid ONNX model in JSON form: .*colour"),
    "dims not numbers": (lambda d: d["graph"]["initializer"][0].update(dims=["x"]), r"not a valid ONNX model in JSON form: .*dims"),
    "graph not an object": (lambda d: d.update(graph=[]), r"a LuisaML JSON model is an object with a 'graph' object"),
    "no node list": (lambda d: d["graph"].pop("node"), r"graph has no 'node' list"),
}


@pytest.mark.parametrize("case", sorted(JSON_BREAKS))
def test_malformed_json_names_the_field(tmp_path, case):
    doc, blob = _worked()
    change, message = JSON_BREAKS[case]
    change(doc)
    mp, wp = tmp_path / "m.json", tmp_path / "w.bin"
    mp.write_text(json.dumps(doc))
    wp.write_bytes(blob)
    with pytest.raises(ModelError, match=r"model file '.*m\.json'.*" + message):
        load_proto(mp, wp)


def test_json_not_an_object_or_not_json(tmp_path):
    mp = tmp_path / "m.json"
    for text, message in (("[1, 2]", "is an object with a 'graph' object"), ("\xff\xfe", "not a JSON text|invalid JSON")):
        mp.write_bytes(text.encode("latin-1"))
        with pytest.raises(ModelError, match=message):
            load_proto(mp)


# ---- constant folding sizes ------------------------------------------------------------------


def _i64(values, name):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _reduced(nodes, inits, out="c"):
    """The nodes, then y = x + ReduceSum(out): a graph that folds the generator if it can."""
    nodes = nodes + [helper.make_node("ReduceSum", [out], ["r"], keepdims=0),
                     helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT), helper.make_node("Add", ["x", "rf"], ["y"])]
    return _graph(nodes, [_vi("x", [1])], [_vi("y", [1])], inits)


@pytest.mark.parametrize("nodes, inits, count", [
    ([helper.make_node("ConstantOfShape", ["s"], ["c"], name="cos")], [_i64([10**6, 10**6], "s")], 10**12),
    ([helper.make_node("Range", ["a", "b", "d"], ["c"], name="rng")], [_i64(0, "a"), _i64(10**12, "b"), _i64(1, "d")], 10**12),
    ([helper.make_node("Tile", ["t", "s"], ["c"], name="tile")],
     [numpy_helper.from_array(np.ones((10, 10), np.float32), "t"), _i64([10**5, 10**5], "s")], 10**12),
    ([helper.make_node("Expand", ["t", "s"], ["c"], name="exp")],
     [numpy_helper.from_array(np.ones(1, np.int64), "t"), _i64([10**5, 10**5], "s")], 10**10),
])
def test_huge_folded_constant_is_a_limit_error(nodes, inits, count):
    """Used to end in numpy's (or onnx's) MemoryError, or the OOM killer."""
    node = nodes[0]
    with pytest.raises(LimitError, match=rf"node '{node.name}' \({node.op_type}\) output 'c' has {count:,} elements"):
        compiler.prepare(_reduced(nodes, inits), batch_axis=None)


def test_fold_bytes_limit_names_the_node():
    m = _reduced([helper.make_node("ConstantOfShape", ["s"], ["c"], name="cos")], [_i64([100, 100], "s")])
    with pytest.raises(LimitError, match=r"node 'cos' \(ConstantOfShape\), evaluated on the host to fold it, needs "
                                         r"39\.1 KiB, more than the limit of 1000 bytes \(luisaml.Limits.fold_bytes\)"):
        fold_to_fixpoint(m, infer_shapes, limits=Limits(fold_bytes=1000))
    folded = fold_to_fixpoint(_reduced([helper.make_node("ConstantOfShape", ["s"], ["c"], name="cos")],
                                       [_i64([100, 100], "s")]), infer_shapes)
    r = next(t for t in folded.graph.initializer if t.name == "rf")  # the default limit folds it
    assert numpy_helper.to_array(r) == np.zeros((100, 100), np.float32).sum()


def test_integer_range_onnx_would_materialise():
    """onnx's shape inference expands an integer Range of constants into shape data (~160 B each)."""
    m = _reduced([helper.make_node("Range", ["a", "b", "d"], ["c"], name="rng")], [_i64(0, "a"), _i64(10**8, "b"), _i64(1, "d")])
    with pytest.raises(LimitError, match=r"node 'rng' \(Range\) makes a constant of 100,000,000 integers; onnx's shape "
                                         r"inference materialises .*luisaml\.Limits\.fold_bytes"):
        compiler.prepare(m, batch_axis=None)


def test_static_intermediate_beyond_32_bit_indexing():
    m = _graph([helper.make_node("Expand", ["x", "s"], ["big"], name="grow"), helper.make_node("ReduceSum", ["big"], ["y"])],
               [_vi("x", [1])], [_vi("y", None)], [_i64([100_000, 100_000], "s")])
    with pytest.raises(LimitError, match=r"tensor 'big' \[100000, 100000\] \(output of node 'grow' \(Expand\)\) has "
                                         rf"10,000,000,000 elements; .* at most {INDEX_LIMIT:,}"):
        compiler.prepare(m, batch_axis=None)


def test_graph_input_beyond_32_bit_indexing():
    m = _graph([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", ["N", 100_000, 100_000])], [_vi("y", ["N", 100_000, 100_000])])
    with pytest.raises(LimitError, match=r"graph input 'x' \(its static dims \[100000, 100000\]\) has 10,000,000,000 elements"):
        compiler.prepare(m)


# ---- names, attributes and tensor data -------------------------------------------------------


@pytest.mark.parametrize("old, new, field", [(b"fc1", b"f\xffc", r"model\.graph\.node\[0\]\.name"),
                                             (b"Relu", b"R\xfelu", r"model\.graph\.node\[1\]\.op_type \('act'\)")])
def test_names_that_are_not_utf8(tmp_path, old, new, field):
    """protobuf hands invalid UTF-8 over as bytes, which later steps trip on."""
    raw = _mlp().SerializeToString()
    assert raw.count(old) == 1
    (tmp_path / "m.onnx").write_bytes(raw.replace(old, new))
    with pytest.raises(ModelError, match=rf"{field}: \w+ b'.*' is not valid UTF-8 text"):
        luisaml.compile(tmp_path / "m.onnx")


def test_attribute_of_the_wrong_type():
    m = _graph([helper.make_node("Softmax", ["x"], ["y"], name="sm", axis=[1])], [_vi("x", [2, 3])], [_vi("y", [2, 3])])
    spec = onnx.defs.get_schema("Softmax", 17, "").attributes["axis"]
    want = onnx.AttributeProto.AttributeType.Name(int(spec.type))
    with pytest.raises(CompileError, match=rf"node 'sm' \(Softmax\) attribute 'axis' is INTS, but Softmax-13 takes {want}"):
        luisaml.compile(m, batch_axis=None)


@pytest.mark.parametrize("case", ["no data", "short float_data", "unknown element type", "undecodable int8"])
def test_initializer_data_that_does_not_fit(case):
    t = numpy_helper.from_array(np.ones((2, 3), np.float32), "w")
    if case == "no data":
        t.ClearField("raw_data")
        message = r"'w': has no data, but float\[2, 3\] holds 6 elements"
    elif case == "short float_data":
        t.ClearField("raw_data")
        t.float_data.extend([1.0] * 5)
        message = r"'w': float_data holds 5 values, expected 6 for float\[2, 3\]"
    elif case == "unknown element type":
        t.data_type = 999
        message = r"'w': element type 999 is not an ONNX element type"
    else:
        t.data_type = TensorProto.INT8  # 24 raw bytes for 6 int8 elements
        message = r"'w': cannot decode int8\[2, 3\]"
    m = _graph([helper.make_node("Add", ["x", "w"], ["y"])], [_vi("x", [2, 3])], [_vi("y", [2, 3])], [t])
    with pytest.raises(ModelError, match=message):
        compiler.prepare(m, batch_axis=None)
    with pytest.raises(ModelError, match=message):
        luisaml.compile(m, batch_axis=None)


def test_constant_attribute_tensor_checked():
    bad = numpy_helper.from_array(np.ones(4, np.float32), "v")
    bad.raw_data = bad.raw_data[:-4]
    m = _graph([helper.make_node("Constant", [], ["c"], value=bad, name="k"), helper.make_node("Add", ["x", "c"], ["y"])],
               [_vi("x", [4])], [_vi("y", [4])])
    with pytest.raises(ModelError, match=r"node 'k' \(Constant\) attribute 'value' tensor 'v': raw_data has 12 bytes, expected 16"):
        compiler.prepare(m, batch_axis=None)


def test_external_data_over_the_weight_limit(tmp_path):
    weights = _weights(_mlp())
    onnx.save(_mlp(), tmp_path / "ext.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="ext.data", size_threshold=0)
    total = sum(v.nbytes for v in weights.values())
    with pytest.raises(LimitError, match=r"model file '.*ext\.onnx' \(its largest: initializer 'w1' in 'ext\.data', "
                                         r"96 bytes\) needs .* more than the limit of 100 bytes .*weight_bytes"):
        load_proto(tmp_path / "ext.onnx", limits=Limits(weight_bytes=100))
    loaded = load_proto(tmp_path / "ext.onnx", limits=Limits(weight_bytes=total))
    for t in loaded.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(t), weights[t.name])
