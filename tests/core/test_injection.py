"""Model text never becomes code: names built from every character str.splitlines() breaks on and
from Python syntax, placed in every name a model carries, must neither run (no marker file) nor
break compiling; distinct names never merge into one identifier."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import luisaml
from luisaml.safe_source import Identifiers, check_source
from tests.util import ort_run

BREAKS = ["\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


def payloads(marker: str) -> list[str]:
    """Names that would create `marker` if any reached the generated module as code."""
    code = f"import pathlib;pathlib.Path({marker!r}).touch()"
    out = [f"{b}{code}#" for b in BREAKS]
    out += [f"x{b}{code}\n#" for b in BREAKS]
    for b in ("\r", "\u2028"):
        out += [f"'''{b}{code}#'''", f'"""{b}{code}#"""', f"a){b}{code}#(", f"\\{b}{code}#"]
    return out


def _model(names: dict[str, str]) -> onnx.ModelProto:
    """x -> Relu -> If(cond) {Neg | Abs} -> y, every name taken from `names`."""
    x, h, y, c = names["x"], names["h"], names["y"], names["cond"]
    then_out, else_out = names["then"], names["else"]
    then_g = helper.make_graph([helper.make_node("Neg", [h], [then_out], name=names["branch_node"])], names["graph"],
                               [], [helper.make_tensor_value_info(then_out, TensorProto.FLOAT, None)])
    else_g = helper.make_graph([helper.make_node("Abs", [h], [else_out], name=names["branch_node"] + "2")],
                               names["graph"] + "2", [], [helper.make_tensor_value_info(else_out, TensorProto.FLOAT, None)])
    nodes = [
        helper.make_node("Relu", [x], [h], name=names["node"]),
        helper.make_node("If", [c], [y], name=names["node"] + "if", then_branch=then_g, else_branch=else_g),
    ]
    g = helper.make_graph(nodes, names["graph"],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["N", 4]),
                           helper.make_tensor_value_info(c, TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["N", 4])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _feeds(model) -> dict[str, np.ndarray]:
    x, c = (i.name for i in model.graph.input)
    return {x: np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4), c: np.array(True)}


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "INJECTED"
    yield str(path)
    assert not path.exists(), "model text ran as code"


def test_no_name_runs_as_code(marker):
    """Every payload in every name slot compiles to a network equal to onnxruntime's."""
    roles = ["x", "h", "y", "cond", "then", "else", "node", "branch_node", "graph"]
    for k, p in enumerate(payloads(marker)):
        names = {r: f"{r}{k}{p}" for r in roles}
        model = _model(names)
        net = luisaml.compile(model)
        feeds = _feeds(model)
        got, want = net.run(feeds), ort_run(model, feeds)
        for name, w in want.items():
            np.testing.assert_array_equal(got[name], w)
        inst = luisaml.NetworkInstance(model)
        for name, v in feeds.items():
            inst.set_input(name, v)
        inst.forward()


def test_file_name_and_cli(tmp_path, marker):
    """A model file whose name carries a payload: compile, and `luisaml run` in a subprocess."""
    names = {r: r for r in ["x", "h", "y", "cond", "then", "else", "node", "branch_node", "graph"]}
    for k, p in enumerate(payloads(marker)[:4]):
        if "\n" in p or "/" in p:
            p = p.replace("\n", "\r").replace("/", "_")
        path = tmp_path / f"m{k}{p}.onnx"
        onnx.save(_model(names), str(path))
        luisaml.compile(str(path))
        r = subprocess.run([sys.executable, "-m", "luisaml.cli", "run", str(path), "--backend", "cpu"],
                           capture_output=True, text=True, env={**os.environ, "LUISAML_BACKEND": "cpu"})
        assert r.returncode in (0, 2), r.stderr


def test_distinct_names_never_merge():
    """'a.b' and 'a_b', NFKC-equal names and keywords are distinct inputs of one network."""
    ins = ["a.b", "a_b", "\ufb01", "fi", "\u210c", "H", "lambda", "None", "__import__", "a" * 200, "a" * 201]
    nodes, outs = [], []
    for k, name in enumerate(ins):
        nodes.append(helper.make_node("Mul", [name, "scale"], [f"o{k}"], name=f"n{k}"))
        outs.append(helper.make_tensor_value_info(f"o{k}", TensorProto.FLOAT, ["N", 2]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 2]) for n in ins], outs,
                          [helper.make_tensor("scale", TensorProto.FLOAT, [], [3.0])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {n: np.full((2, 2), k, np.float32) for k, n in enumerate(ins)}
    got = luisaml.compile(model).run(feeds)
    for k in range(len(ins)):
        np.testing.assert_array_equal(got[f"o{k}"], feeds[ins[k]] * 3)


def test_identifiers_are_ascii_and_distinct():
    ids = Identifiers()
    names = ["a.b", "a_b", "\ufb01", "fi", "\u210c", "H", "x\ry", "x\ny"] + [f"n{k}" for k in range(20)]
    got = [ids.get(n, "x") for n in names]
    assert len(set(got)) == len(got)
    assert all(g.isascii() and g.isidentifier() for g in got)
    assert ids.get("a.b", "x") == got[0]  # stable


@pytest.mark.parametrize("bad", [
    "import os\n",
    "x = 1\n",
    "@luisa.func\ndef f(a):\n    __import__('os')\n",
    "@luisa.func\ndef f(a):\n    a = 'text'\n",
    "@luisa.func\ndef f(a):\n    a = open\n    a('x')\n",
    "@luisa.func\ndef f(a):\n    a.__class__\n",
    "@luisa.func\ndef f(a):\n    a = 4294967296\n",
    "@luisa.func\ndef f(a):\n    a = 1  # \r__import__('os')\n",
    "import luisa\n@luisa.func\ndef f(a):\n    a = [b for b in range(3)]\n",
])
def test_check_source_refuses(bad):
    with pytest.raises(luisaml.CompileError, match="internal error"):
        check_source(bad)
