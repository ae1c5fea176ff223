"""`luisaml inspect`'s report (luisaml/report.py): per node its stage, outputs, parameters, FLOPs
and bytes; the totals; the stages and both allocations; --json with stable keys; and --html, one
self-contained page rendered headless in Chromium (Playwright) with a group per stage in the graph
and a bar per allocated tensor in the live-range charts."""
from __future__ import annotations

import json
import os
import tempfile

import numpy as np
import onnx
import pytest
from onnx import helper
from util import graph_model, rand, unsupported_node_model

from luisaml import planning, report, runtime
from luisaml.cli import main

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREENSHOT = os.path.join(tempfile.gettempdir(), "luisaml-inspect-report.png")


def _cnn(name_c1: str = "c1") -> onnx.ModelProto:
    """x[N,3,8,8] -> Conv -> Relu (read twice: by a second Conv and a residual Add) -> MaxPool ->
    Flatten -> Gemm -> Softmax."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name=name_c1, pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="c2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "r1"], ["a"], name="add"),
        helper.make_node("MaxPool", ["a"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["g"], name="fc", transB=1),
        helper.make_node("Softmax", ["g"], ["y"], name="softmax", axis=-1),
    ]
    inits = {"w1": rand((8, 3, 3, 3), seed=1), "b1": rand((8,), seed=2), "w2": rand((8, 8, 3, 3), seed=3),
             "b2": rand((8,), seed=4), "wf": rand((10, 128), seed=5), "bf": rand((10,), seed=6)}
    return graph_model(nodes, {"x": rand((2, 3, 8, 8))}, inits, opset=17, batch="N")


@pytest.fixture(scope="module")
def cnn_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("report") / "cnn.onnx")
    onnx.save(_cnn(), path)
    return path


def test_nodes_totals_and_stages(cnn_path):
    rep = report.build(cnn_path)
    plan = runtime.analyze(cnn_path)
    nodes = {d["name"]: d for d in rep["nodes"]}
    assert [d["name"] for d in rep["nodes"]] == [n.name for n, _ in plan.ops]
    # FLOPs by the documented formulas (per sample: out 8x8x8 = 512 elements)
    assert {k: nodes[k]["flops"] for k in nodes} == {
        "c1": 2 * 512 * 27 + 512, "relu": 512, "c2": 2 * 512 * 72 + 512, "add": 512, "pool": 128 * 4,
        "flatten": 0, "fc": 2 * 10 * 128 + 10, "softmax": 5 * 10}
    assert {k: nodes[k]["params"] for k in nodes} == {
        "c1": 8 * 27 + 8, "relu": 0, "c2": 8 * 72 + 8, "add": 0, "pool": 0, "flatten": 0, "fc": 1280 + 10, "softmax": 0}
    assert nodes["c1"]["bytes"] == (3 * 64 + 512) * 4 and nodes["add"]["bytes"] == 3 * 512 * 4
    assert nodes["c1"]["outputs"] == [{"name": "c1", "dtype": "float", "shape": ["N", 8, 8, 8]}]
    assert nodes["fc"]["outputs"][0]["shape"] == ["N", 10] and nodes["flatten"]["role"] == "view"
    t = rep["totals"]
    assert t["flops"] == sum(d["flops"] for d in nodes.values()) and t["flops_unknown"] == []
    assert t["params"] == 224 + 584 + 1290 and t["nodes"] == 8
    assert t["weight_blob_bytes"] == plan.blob.size
    assert rep["per_sample"] is True and rep["batch_symbol"] == "N"
    assert rep["inputs"] == [{"name": "x", "dtype": "float", "shape": ["N", 3, 8, 8]}]
    # every node's stage is the stage that holds it
    stages = plan.schedule.stages
    assert [s["describe"] for s in rep["stages"]] == [st.describe() for st in stages]
    for d in rep["nodes"]:
        if d["role"] in ("root", "group"):
            assert d["name"] in [n.name for n, _ in stages[d["stage"]].nodes]
        elif d["role"] == "epilogue":
            assert d["name"] in [n.name for n, _ in stages[d["stage"]].epilogue]
        elif d["role"] == "inline":
            assert d["inlined_in"] and all(d["name"] in rep["stages"][k]["inlined"] for k in d["inlined_in"])
        else:
            assert d["role"] == "view" and d["stage"] is None
    # both allocations: every pooled tensor once, with its slot and live range
    regs, bufs = rep["registers"], rep["buffers"]
    assert {r["name"]: r["slot"] for r in regs["tensors"]} == plan.allocation.slot_of
    assert {r["name"]: r["slot"] for r in bufs["tensors"]} == plan.schedule.buffers.slot_of
    assert {r["name"]: (r["first"], r["last"]) for r in bufs["tensors"]} == {
        k: v for k, v in plan.schedule.buffers.live.items() if k in plan.schedule.buffers.slot_of}
    assert len(regs["steps"]) == len(plan.ops) and len(bufs["steps"]) == len(stages)
    assert regs["bytes"] == plan.allocation.bytes_pooled and 0 < regs["peak_bytes"] <= regs["bytes"]
    assert bufs["peak_bytes"] == max(bufs["live_bytes"]) <= bufs["bytes"]


def test_flop_formulas_of_other_operators():
    x = rand((2, 4, 6, 6))
    nodes = [
        helper.make_node("Conv", ["x", "wg"], ["cg"], name="grouped", group=2),  # [N,4,4,4], C/group = 2
        helper.make_node("ConvTranspose", ["x", "wt"], ["ct"], name="deconv"),  # in 4x6x6, M/group = 3, k 2x2
        helper.make_node("ReduceMean", ["x", "axes"], ["rm"], name="mean", keepdims=0),
        helper.make_node("GlobalAveragePool", ["x"], ["gap"], name="gap"),
        helper.make_node("LayerNormalization", ["x", "ls", "lb"], ["ln"], name="ln", axis=-1),
        helper.make_node("MatMul", ["x", "wm"], ["mm"], name="matmul"),  # [N,4,6,6] x [6,5]
        helper.make_node("TopK", ["x", "k"], ["tv", "ti"], name="topk"),
    ]
    inits = {"wg": rand((4, 2, 3, 3)), "wt": rand((4, 3, 2, 2)), "axes": np.array([2, 3], np.int64),
             "ls": rand((6,)), "lb": rand((6,)), "wm": rand((6, 5)), "k": np.array([2], np.int64)}
    rep = report.from_plan(runtime.analyze(graph_model(nodes, {"x": x}, inits, opset=18, batch="N")))
    flops = {d["name"]: d["flops"] for d in rep["nodes"]}
    assert flops["grouped"] == 2 * (4 * 4 * 4) * (2 * 9)
    assert flops["deconv"] == 2 * (4 * 36) * (3 * 4)
    assert flops["mean"] == flops["gap"] == 4 * 36
    assert flops["ln"] == 144 * (5 + 2)
    assert flops["matmul"] == 2 * (4 * 6 * 5) * 6
    assert flops["topk"] is None and rep["totals"]["flops_unknown"] == ["topk"]
    assert "without a formula: topk" in report.text(rep)


def test_a_graph_whose_batch_moves_and_one_per_sample_kernel():
    nodes = [helper.make_node("Transpose", ["x"], ["t"], name="t", perm=[1, 0, 2]),
             helper.make_node("Softmax", ["t"], ["s"], name="softmax", axis=1),  # across the batch
             helper.make_node("Transpose", ["s"], ["y"], name="back", perm=[1, 0, 2])]
    model = graph_model(nodes, {"x": rand((2, 3, 4))}, batch="B")
    plan, why, _ = planning.plan_for(model, "moves", planning.CompileOptions().resolve("cpu"))
    rep = report.from_plan(plan, model_name="moves", why=why)
    assert rep["per_sample"] is False and "batch" in rep["per_sample_impossible"]
    assert "per-sample execution: impossible" in report.text(rep)
    rep = report.from_plan(runtime.analyze(_cnn(), schedule="per-sample"))
    assert rep["stages"] is None and rep["buffers"] is None
    assert {d["role"] for d in rep["nodes"]} == {"kernel", "view"}
    page = report.html(rep)
    assert "the per-sample kernel" in page and "class='stage" not in page


def test_inspect_json_is_one_document_with_the_documented_keys(cnn_path, capsys):
    assert main(["inspect", cnn_path, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"schema", "model", "opsets", "batch_symbol", "per_sample", "per_sample_impossible", "inputs",
                        "outputs", "op_counts", "unsupported", "nodes", "totals", "stages", "registers", "buffers",
                        "batch_kernel", "host_steps"}
    assert doc["host_steps"] == []
    assert doc["schema"] == 1 and doc["model"] == "cnn.onnx" and doc["op_counts"]["Conv"] == 2
    assert set(doc["nodes"][0]) == {"name", "op_type", "domain", "inputs", "outputs", "stage", "role", "inlined_in",
                                    "params", "flops", "bytes", "note"}
    assert set(doc["totals"]) == {"nodes", "params", "flops", "flops_unknown", "bytes", "weight_blob_bytes",
                                  "weight_tensors"}
    assert set(doc["stages"][0]) == {"index", "domain", "items", "batched", "out", "nodes", "epilogue", "inlined",
                                     "reads", "writes", "describe", "registers", "threads", "readback"}
    assert set(doc["registers"]) == {"steps", "slots", "tensors", "bytes", "bytes_unpooled", "live_bytes",
                                     "peak_bytes", "inplace", "views"}
    assert set(doc["registers"]["tensors"][0]) == {"name", "slot", "first", "last", "elements", "bytes"}
    assert set(doc["registers"]["slots"][0]) == {"id", "space", "dtype", "elements", "bytes", "members"}
    # the text says the same
    assert main(["inspect", cnn_path]) == 0
    out = capsys.readouterr().out
    assert "totals: 8 nodes, 2,098 parameters" in out and "stage 0 [" in out and "register allocation: " in out


def test_inspect_json_of_unsupported_nodes_exits_1(tmp_path, capsys):
    onnx.save(unsupported_node_model(), tmp_path / "u.onnx")
    assert main(["inspect", str(tmp_path / "u.onnx"), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["unsupported"] and "mystery" in doc["unsupported"][0] and doc["nodes"] == [] and doc["stages"] is None


def test_html_escapes_model_text(tmp_path):
    evil = "</text><script>alert(1)</script><text>"
    page = report.html(report.from_plan(runtime.analyze(_cnn(name_c1=evil))))
    assert "<script" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page


def _chromium():
    """Return (sync_playwright, launch keywords), or skip saying what is missing."""
    sync = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install playwright)")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"Chromium is not installed at {CHROMIUM} (apt-get install chromium)")
    return sync.sync_playwright, {"executable_path": CHROMIUM, "args": CHROMIUM_ARGS, "headless": True}


def test_inspect_html_renders_the_graph_by_stage_and_the_live_ranges(cnn_path, tmp_path, capsys):
    sync_playwright, launch = _chromium()
    page_path = tmp_path / "report.html"
    assert main(["inspect", cnn_path, "--html", str(page_path)]) == 0
    assert "wrote" in capsys.readouterr().err
    plan = runtime.analyze(cnn_path)
    stages = plan.schedule.stages
    requests = []
    with sync_playwright() as p:
        browser = p.chromium.launch(**launch)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})

            def route(r):  # the page is self-contained: nothing but itself may be fetched
                requests.append(r.request.url)
                r.continue_() if r.request.url.startswith("file://") else r.abort()

            page.route("**/*", route)
            page.goto(page_path.as_uri())
            assert page.locator("#graph g.stage").count() == len(stages)
            for st in stages:
                box = page.locator(f"#graph g.stage[data-stage='{st.index}']")
                assert box.count() == 1
                assert all(box.locator("text", has_text=n.name).count() >= 1 for n, _ in st.nodes)
            assert page.locator("#graph g.edge").count() >= len(stages)  # inputs -> ... -> outputs at least
            bars = page.locator("#registers rect.bar")
            assert bars.count() == len(plan.allocation.slot_of)
            assert sorted(bars.evaluate_all("rs => rs.map(r => r.dataset.tensor)")) == sorted(plan.allocation.slot_of)
            assert page.locator("#buffers rect.bar").count() == len(plan.schedule.buffers.slot_of)
            for chart in ("#graph", "#registers", "#buffers"):
                bb = page.locator(chart).bounding_box()
                assert bb is not None and bb["width"] > 200 and bb["height"] > 100, chart
            bb = bars.first.bounding_box()
            assert bb is not None and bb["width"] > 1 and bb["height"] > 5  # drawn, not collapsed
            assert page.locator("script").count() == 0
            page.screenshot(path=SCREENSHOT, full_page=True)
        finally:
            browser.close()
    assert requests == [page_path.as_uri()]
    assert os.path.getsize(SCREENSHOT) > 10_000
