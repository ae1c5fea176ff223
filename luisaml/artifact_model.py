"""A prepared model (passes.Prepared) and the options compile gave build_plan, as strict data and back:
what a .lml artifact stores so that `luisaml.load` generates the module again, with the same
emission compile uses, instead of running any text from the file.

The data is one JSON document (`model.json`) and one raw byte string (`weights.bin`):

- `model`: the opsets, and the main graph: its name, inputs, outputs, variables (name, element type,
  shape with symbols, the symbolic value of shape arithmetic, the constant's array) and nodes (name,
  op type, domain, inputs, outputs, attributes as typed values: int, float (as float.hex, so that
  inf and nan survive and nothing is rounded), str, their lists, arrays, subgraphs);
- `batch`: the BatchPlan (passes/batch.py): every variable's per-sample shape, its relation to the
  batch, the per-sample value of a constant;
- `prepared`: float64_as_float and the inputs whose rows are bound at run time;
- `options`: build_plan's arguments (the fuse mode, precision, limits, ... that compile resolved);
- `arrays`: the table of every array above, each stored once in `weights.bin` (dtype, shape,
  offset), laid end to end at 16-byte boundaries, so that the member's size is exactly what the table
  describes (no hole, no overlap, nothing past the end).

`decode` checks every type, range and reference and refuses an unknown key; any fault is an
ArtifactError naming where in the document it is. Nothing here imports onnx."""
from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from typing import Any

import numpy as np

from . import dtypes, registry
from .errors import ArtifactError, UsageError
from .limits import Limits
from .operators.mlp import MLPConfig
from .model import Graph, Model, Node, Variable, subgraphs
from .passes import Prepared
from .passes.batch import BatchDim, BatchPlan

SCHEMA = 1
ALIGN = 16
# the numpy element types an array may have, little-endian (the host order of every supported machine)
ARRAY_DTYPES = frozenset({"|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8",
                          "<c8", "<c16"})
MAX_INT = 2**63 - 1
MAX_RANK = 64
_HEX = re.compile(r"[0-9a-f]{64}")
_FUSE = ("off", "gpu", "emulated")
_PRECISION = ("fp32", "fp16")
_SCHEDULE = ("stages", "per-sample")
_WINOGRAD = (0, 2, 4)


# ---- encoding -------------------------------------------------------------------------------
class _Arrays:
    """The array table and the bytes of weights.bin; an array of the same dtype, shape and bytes is
    stored once."""

    def __init__(self) -> None:
        self.table: list[dict] = []
        self.parts: list[bytes] = []
        self.size = 0
        self._index: dict[tuple, int] = {}

    def add(self, a, where: str) -> int:
        a = np.asarray(a)
        if a.dtype.kind not in "biufc" or a.dtype.fields is not None:
            raise UsageError(f"cannot save {where}: an array of {a.dtype} (an artifact holds numeric arrays only)")
        a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype)
        if a.dtype.str not in ARRAY_DTYPES:
            raise UsageError(f"cannot save {where}: an array of {a.dtype}")
        raw = a.tobytes()
        key = (a.dtype.str, a.shape, hashlib.sha256(raw).digest())
        if key in self._index:
            return self._index[key]
        pad = -self.size % ALIGN
        if pad:
            self.parts.append(b"\0" * pad)
            self.size += pad
        self.table.append({"dtype": a.dtype.str, "shape": list(a.shape), "offset": self.size})
        self.parts.append(raw)
        self.size += len(raw)
        self._index[key] = len(self.table) - 1
        return self._index[key]


def _dtype_data(d: dtypes.DType | None):
    return None if d is None else [d.name, bool(d.computes_as_float)]


def _dims_data(dims) -> list | None:
    return None if dims is None else [d if isinstance(d, str) else int(d) for d in dims]


def _attr_data(value, arrays: _Arrays, where: str) -> list:
    if isinstance(value, bool):
        return ["b", value]
    if isinstance(value, int):
        return ["i", value]
    if isinstance(value, float):
        return ["f", value.hex()]
    if isinstance(value, str):
        return ["s", value]
    if isinstance(value, np.ndarray):
        return ["t", arrays.add(value, where)]
    if isinstance(value, Graph):
        return ["g", _graph_data(value, arrays)]
    if value is None:
        return ["none", None]
    if isinstance(value, list):
        kinds = {type(v) for v in value}
        if not value:
            return ["list", []]
        if kinds == {int}:
            return ["ints", list(value)]
        if kinds == {float}:
            return ["floats", [v.hex() for v in value]]
        if kinds == {str}:
            return ["strs", list(value)]
        if all(isinstance(v, np.ndarray) for v in value):
            return ["ts", [arrays.add(v, where) for v in value]]
        if all(isinstance(v, Graph) for v in value):
            return ["gs", [_graph_data(v, arrays) for v in value]]
    raise UsageError(f"cannot save {where}: its value is a {type(value).__name__}, which an artifact cannot hold")


def _graph_data(g: Graph, arrays: _Arrays) -> dict:
    variables = []
    for name, v in g.vars.items():
        variables.append({"name": name, "dtype": _dtype_data(v.dtype), "shape": _dims_data(v.shape),
                          "value": None if v.value is None else arrays.add(v.value, f"the value of tensor '{name}'"),
                          "symbolic": _dims_data(v.symbolic), "elem": int(v.elem_type)})
    nodes = []
    for n in g.nodes:
        nodes.append({"name": n.name, "op": n.op_type, "domain": n.domain, "inputs": list(n.inputs),
                      "outputs": list(n.outputs),
                      "attrs": [[k, *_attr_data(v, arrays, f"attribute '{k}' of {n.describe()}")]
                                for k, v in n.attrs.items()]})
    return {"name": g.name, "inputs": list(g.inputs), "outputs": list(g.outputs), "vars": variables, "nodes": nodes}


def _mlp_data(mlp: MLPConfig | None):
    if mlp is None:
        return None
    d = dataclasses.asdict(mlp)
    d["tile"] = None if mlp.tile is None else [int(x) for x in mlp.tile]
    return d


def encode(prep: Prepared, model_name: str, options: dict[str, Any]) -> tuple[dict, bytes]:
    """Return (the document, the bytes of weights.bin) of a prepared model and build_plan's options
    (fuse, precision, limits, check_indices, schedule, mlp, merge_stages, blocks, winograd); raise
    UsageError for what an artifact cannot hold."""
    if prep.host_steps is not None:
        raise UsageError("cannot save a network whose grid ops run as steps before the kernels (a grid built from one "
                         "bound at run time, driven from Python): an artifact holds kernels and static data only")
    arrays = _Arrays()
    model = prep.model
    doc = {
        "schema": SCHEMA,
        "model": {"opsets": [[k, int(v)] for k, v in model.opsets.items()], "producer": model.producer,
                  "ir_version": int(model.ir_version), "graph": _graph_data(model.graph, arrays)},
        "batch": {"symbol": prep.batch.symbol, "moved": prep.batch.moved,
                  "dims": [[name, {"shape": [int(x) for x in d.shape], "batched": bool(d.batched),
                                   "onnx_shape": _dims_data(d.onnx_shape), "dependent": bool(d.dependent),
                                   "value": None if d.value is None else arrays.add(d.value, f"the per-sample value of '{name}'")}]
                           for name, d in prep.batch.dims.items()]},
        "prepared": {"float64_as_float": bool(prep.float64_as_float), "bound": [[k, v] for k, v in prep.bound.items()]},
        "options": {"model_name": model_name, "fuse": options["fuse"], "precision": options["precision"],
                    "limits": dataclasses.asdict(options["limits"]), "check_indices": bool(options["check_indices"]),
                    "schedule": options["schedule"], "mlp": _mlp_data(options["mlp"]),
                    "merge_stages": bool(options["merge_stages"]), "blocks": bool(options["blocks"]),
                    "winograd": int(options["winograd"])},
        "arrays": arrays.table,
        "weights_bytes": arrays.size,
    }
    return doc, b"".join(arrays.parts)


# ---- decoding -------------------------------------------------------------------------------
class _Reader:
    """Typed reads of the document, each fault an ArtifactError naming where it is."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, at: str, what: str):
        raise ArtifactError(f"'{self.where}': model.json {at}: {what}")

    def obj(self, v, at: str, keys: tuple[str, ...]) -> dict:
        if not isinstance(v, dict):
            self.fail(at, f"expected an object, found {_kind(v)}")
        unknown = sorted(set(v) - set(keys))
        if unknown:
            self.fail(at, f"unknown key {unknown[0]!r} (expected {', '.join(keys)})")
        missing = [k for k in keys if k not in v]
        if missing:
            self.fail(at, f"no key {missing[0]!r}")
        return v

    def list(self, v, at: str, length: int | None = None) -> list:
        if not isinstance(v, list):
            self.fail(at, f"expected a list, found {_kind(v)}")
        if length is not None and len(v) != length:
            self.fail(at, f"expected {length} items, found {len(v)}")
        return v

    def str(self, v, at: str) -> str:
        if not isinstance(v, str):
            self.fail(at, f"expected a string, found {_kind(v)}")
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            self.fail(at, "a string that is not valid Unicode (a lone surrogate)")
        return v

    def int(self, v, at: str, lo: int = 0, hi: int = MAX_INT) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            self.fail(at, f"expected an integer, found {_kind(v)}")
        if not lo <= v <= hi:
            self.fail(at, f"{v} is outside [{lo}, {hi}]")
        return v

    def bool(self, v, at: str) -> bool:
        if not isinstance(v, bool):
            self.fail(at, f"expected true or false, found {_kind(v)}")
        return v

    def float(self, v, at: str) -> float:
        if not isinstance(v, str):
            self.fail(at, f"expected a float written as float.hex, found {_kind(v)}")
        try:
            return float.fromhex(v)
        except (ValueError, OverflowError):
            self.fail(at, f"{v[:40]!r} is not a float written as float.hex")

    def choice(self, v, at: str, allowed: tuple) -> Any:
        if isinstance(v, bool) or v not in allowed:
            self.fail(at, f"{v!r} is not one of {', '.join(repr(a) for a in allowed)}")
        return v

    def dims(self, v, at: str) -> tuple | None:
        if v is None:
            return None
        out = []
        for k, d in enumerate(self.list(v, at)):
            out.append(self.str(d, f"{at}[{k}]") if isinstance(d, str) else self.int(d, f"{at}[{k}]"))
        if len(out) > MAX_RANK:
            self.fail(at, f"rank {len(out)} (at most {MAX_RANK})")
        return tuple(out)


def _kind(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


class _Decoder(_Reader):
    def __init__(self, where: str, doc_arrays, weights: bytes) -> None:
        super().__init__(where)
        self.weights = weights
        self.table = self._table(doc_arrays)
        self.decoded: dict[int, np.ndarray] = {}

    def _table(self, raw) -> list[tuple[np.dtype, tuple[int, ...], int]]:
        table, end = [], 0
        for k, a in enumerate(self.list(raw, "arrays")):
            at = f"arrays[{k}]"
            self.obj(a, at, ("dtype", "shape", "offset"))
            dt = self.choice(a["dtype"], f"{at}.dtype", tuple(sorted(ARRAY_DTYPES)))
            shape = tuple(self.int(d, f"{at}.shape[{i}]") for i, d in enumerate(self.list(a["shape"], f"{at}.shape")))
            if len(shape) > MAX_RANK:
                self.fail(f"{at}.shape", f"rank {len(shape)} (at most {MAX_RANK})")
            offset = self.int(a["offset"], f"{at}.offset")
            start = end + (-end % ALIGN)
            if offset != start:
                self.fail(f"{at}.offset", f"{offset}, expected {start} (arrays lie end to end at {ALIGN}-byte "
                                          "boundaries in weights.bin)")
            nbytes = math.prod(shape) * np.dtype(dt).itemsize
            if offset + nbytes > len(self.weights):
                self.fail(at, f"{nbytes} bytes at offset {offset} run past the end of weights.bin "
                              f"({len(self.weights)} bytes)")
            end = offset + nbytes
            table.append((np.dtype(dt), shape, offset))
        if end != len(self.weights):
            self.fail("arrays", f"describe {end} bytes of weights.bin, which holds {len(self.weights)}")
        return table

    def array(self, v, at: str) -> np.ndarray:
        k = self.int(v, at, 0, len(self.table) - 1) if self.table else self.fail(at, "no array table entry")
        if k not in self.decoded:
            dt, shape, offset = self.table[k]
            a = np.frombuffer(self.weights, dtype=dt, count=math.prod(shape), offset=offset).reshape(shape).copy()
            self.decoded[k] = a
        return self.decoded[k]

    def dtype(self, v, at: str) -> dtypes.DType | None:
        if v is None:
            return None
        name, as_float = self.list(v, at, 2)
        self.str(name, f"{at}[0]")
        if self.bool(as_float, f"{at}[1]"):
            if name != "DOUBLE":
                self.fail(at, f"{name} computed as float (only DOUBLE is)")
            return dtypes.DOUBLE_AS_FLOAT
        for d in dtypes.SUPPORTED.values():
            if d.name == name:
                return d
        self.fail(at, f"unknown element type {name!r}")

    def attr(self, v, at: str, parent: Graph, model: Model) -> tuple[str, Any]:
        name, kind, value = self.list(v, at, 3)
        self.str(name, f"{at}[0]")
        at = f"{at} ({name!r})"
        if kind == "b":
            return name, self.bool(value, at)
        if kind == "i":
            return name, self.int(value, at, -MAX_INT - 1)
        if kind == "f":
            return name, self.float(value, at)
        if kind == "s":
            return name, self.str(value, at)
        if kind == "t":
            return name, self.array(value, at)
        if kind == "g":
            return name, self.graph(value, at, parent, model)
        if kind == "none":
            if value is not None:
                self.fail(at, "a 'none' attribute holds a value")
            return name, None
        items = self.list(value, at)
        if kind == "list":
            if items:
                self.fail(at, "an untyped list attribute that is not empty")
            return name, []
        conv = {"ints": lambda x, a: self.int(x, a, -MAX_INT - 1), "floats": self.float, "strs": self.str,
                "ts": self.array, "gs": lambda x, a: self.graph(x, a, parent, model)}.get(kind)
        if conv is None:
            self.fail(at, f"unknown attribute kind {kind!r}")
        return name, [conv(x, f"{at}[{i}]") for i, x in enumerate(items)]

    def graph(self, v, at: str, parent: Graph | None, model: Model) -> Graph:
        self.obj(v, at, ("name", "inputs", "outputs", "vars", "nodes"))
        names = lambda key: [self.str(x, f"{at}.{key}[{i}]") for i, x in enumerate(self.list(v[key], f"{at}.{key}"))]  # noqa: E731
        g = Graph(self.str(v["name"], f"{at}.name"), [], names("inputs"), names("outputs"), {}, parent)
        for k, var in enumerate(self.list(v["vars"], f"{at}.vars")):
            vat = f"{at}.vars[{k}]"
            self.obj(var, vat, ("name", "dtype", "shape", "value", "symbolic", "elem"))
            name = self.str(var["name"], f"{vat}.name")
            if name in g.vars:
                self.fail(vat, f"tensor {name!r} is listed twice")
            value = None if var["value"] is None else self.array(var["value"], f"{vat}.value")
            sym = self.dims(var["symbolic"], f"{vat}.symbolic")
            g.vars[name] = Variable(name, self.dtype(var["dtype"], f"{vat}.dtype"), self.dims(var["shape"], f"{vat}.shape"),
                                    value, None if sym is None else list(sym), self.int(var["elem"], f"{vat}.elem", 0, 64))
        for key in ("inputs", "outputs"):
            for name in getattr(g, key):
                if not g.has_var(name):
                    self.fail(f"{at}.{key}", f"{name!r} names no tensor")
        for k, n in enumerate(self.list(v["nodes"], f"{at}.nodes")):
            nat = f"{at}.nodes[{k}]"
            self.obj(n, nat, ("name", "op", "domain", "inputs", "outputs", "attrs"))
            node = Node(self.str(n["name"], f"{nat}.name"), self.str(n["op"], f"{nat}.op"),
                        self.str(n["domain"], f"{nat}.domain"),
                        [self.str(x, f"{nat}.inputs[{i}]") for i, x in enumerate(self.list(n["inputs"], f"{nat}.inputs"))],
                        [self.str(x, f"{nat}.outputs[{i}]") for i, x in enumerate(self.list(n["outputs"], f"{nat}.outputs"))])
            if registry.resolve(node.op_type, node.domain, model.opset(node.domain)) is None:
                plugin = node.domain not in ("", "ai.onnx")
                self.fail(nat, f"{node.describe()}: no operator {node.domain + '::' if plugin else ''}{node.op_type} is "
                               f"registered for opset {model.opset(node.domain)} in this process"
                          + (" (a plugin operator: import the module that registers it before luisaml.load)" if plugin else ""))
            for i, name in enumerate(node.inputs):
                if name and not g.has_var(name):
                    self.fail(f"{nat}.inputs[{i}]", f"{name!r} names no tensor")
            for i, name in enumerate(node.outputs):
                if name and name not in g.vars:
                    self.fail(f"{nat}.outputs[{i}]", f"{name!r} names no tensor of graph {g.name!r}")
            for i, a in enumerate(self.list(n["attrs"], f"{nat}.attrs")):
                key, value = self.attr(a, f"{nat}.attrs[{i}]", g, model)
                if key in node.attrs:
                    self.fail(f"{nat}.attrs[{i}]", f"attribute {key!r} given twice")
                node.attrs[key] = value
            g.nodes.append(node)
        return g

    def batch(self, v, model: Model) -> BatchPlan:
        at = "batch"
        self.obj(v, at, ("symbol", "moved", "dims"))
        symbol = None if v["symbol"] is None else self.str(v["symbol"], f"{at}.symbol")
        moved = None if v["moved"] is None else self.str(v["moved"], f"{at}.moved")
        known = set()
        graphs = [model.graph]
        while graphs:
            g = graphs.pop()
            known |= set(g.vars)
            graphs += [s for n in g.nodes for s in subgraphs(n)]
        plan = BatchPlan(symbol, {}, moved)
        for k, item in enumerate(self.list(v["dims"], f"{at}.dims")):
            dat = f"{at}.dims[{k}]"
            name, d = self.list(item, dat, 2)
            self.str(name, f"{dat}[0]")
            if name not in known:
                self.fail(dat, f"{name!r} names no tensor")
            self.obj(d, dat, ("shape", "batched", "onnx_shape", "dependent", "value"))
            shape = tuple(self.int(x, f"{dat}.shape[{i}]") for i, x in enumerate(self.list(d["shape"], f"{dat}.shape")))
            value = None if d["value"] is None else self.array(d["value"], f"{dat}.value")
            plan.dims[name] = BatchDim(shape, self.bool(d["batched"], f"{dat}.batched"),
                                       self.dims(d["onnx_shape"], f"{dat}.onnx_shape"),
                                       self.bool(d["dependent"], f"{dat}.dependent"), value)
        return plan

    def options(self, v) -> tuple[str, dict[str, Any]]:
        at = "options"
        self.obj(v, at, ("model_name", "fuse", "precision", "limits", "check_indices", "schedule", "mlp",
                         "merge_stages", "blocks", "winograd"))
        fields = [f.name for f in dataclasses.fields(Limits)]
        lim = self.obj(v["limits"], f"{at}.limits", tuple(fields))
        limits = Limits(**{k: self.int(lim[k], f"{at}.limits.{k}") for k in fields})
        mlp = None
        if v["mlp"] is not None:
            names = tuple(f.name for f in dataclasses.fields(MLPConfig))
            m = self.obj(v["mlp"], f"{at}.mlp", names)
            args: dict[str, Any] = {}
            for k in names:
                x, mat = m[k], f"{at}.mlp.{k}"
                if x is None or k == "max_acc":
                    args[k] = x if x is None else self.int(x, mat, 1, 1 << 16)
                elif k in ("T", "NT", "U", "blocks_per_sm"):
                    args[k] = self.int(x, mat, 1, 1 << 16)
                elif k == "tile":
                    args[k] = tuple(self.int(t, f"{mat}[{i}]", 1, 1 << 16) for i, t in enumerate(self.list(x, mat, 2)))
                elif k == "weights":
                    args[k] = self.str(x, mat)
                else:
                    args[k] = self.bool(x, mat)
            if args.get("max_acc") is None:
                self.fail(f"{at}.mlp.max_acc", "null (expected an integer)")
            try:
                mlp = MLPConfig(**args)
            except UsageError as e:
                self.fail(f"{at}.mlp", str(e))
        return self.str(v["model_name"], f"{at}.model_name"), {
            "fuse": self.choice(v["fuse"], f"{at}.fuse", _FUSE),
            "precision": self.choice(v["precision"], f"{at}.precision", _PRECISION),
            "limits": limits, "check_indices": self.bool(v["check_indices"], f"{at}.check_indices"),
            "schedule": self.choice(v["schedule"], f"{at}.schedule", _SCHEDULE), "mlp": mlp,
            "merge_stages": self.bool(v["merge_stages"], f"{at}.merge_stages"),
            "blocks": self.bool(v["blocks"], f"{at}.blocks"),
            "winograd": self.choice(v["winograd"], f"{at}.winograd", _WINOGRAD),
        }


def decode(doc, weights: bytes, where: str) -> tuple[Prepared, str, dict[str, Any]]:
    """Return (the Prepared, the model name, build_plan's options) of a document and the bytes of
    weights.bin; raise ArtifactError for anything that is not exactly what `encode` writes."""
    r = _Reader(where)
    r.obj(doc, "(top level)", ("schema", "model", "batch", "prepared", "options", "arrays", "weights_bytes"))
    if r.int(doc["schema"], "schema") != SCHEMA:
        r.fail("schema", f"{doc['schema']}, this luisaml reads {SCHEMA}")
    if r.int(doc["weights_bytes"], "weights_bytes") != len(weights):
        r.fail("weights_bytes", f"{doc['weights_bytes']}, but weights.bin holds {len(weights)} bytes")
    d = _Decoder(where, doc["arrays"], weights)
    m = d.obj(doc["model"], "model", ("opsets", "producer", "ir_version", "graph"))
    opsets = {}
    for k, item in enumerate(d.list(m["opsets"], "model.opsets")):
        dom, ver = d.list(item, f"model.opsets[{k}]", 2)
        opsets[d.str(dom, f"model.opsets[{k}][0]")] = d.int(ver, f"model.opsets[{k}][1]", 1, 10_000)
    model = Model(None, opsets, d.str(m["producer"], "model.producer"), d.int(m["ir_version"], "model.ir_version"))  # type: ignore[arg-type]
    model.graph = d.graph(m["graph"], "model.graph", None, model)
    batch = d.batch(doc["batch"], model)
    p = d.obj(doc["prepared"], "prepared", ("float64_as_float", "bound"))
    bound = {}
    for k, item in enumerate(d.list(p["bound"], "prepared.bound")):
        name, sym = d.list(item, f"prepared.bound[{k}]", 2)
        if d.str(name, f"prepared.bound[{k}][0]") not in model.graph.inputs:
            d.fail(f"prepared.bound[{k}]", f"{name!r} is not an input of the graph")
        bound[name] = d.str(sym, f"prepared.bound[{k}][1]")
    prep = Prepared(model, batch, registry.Binding(model.opsets), d.bool(p["float64_as_float"], "prepared.float64_as_float"), bound)
    name, options = d.options(doc["options"])
    return prep, name, options


__all__ = ["encode", "decode", "SCHEMA"]
