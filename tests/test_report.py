"""`luisaml inspect`'s report (luisaml/report.py): per node its stage, outputs, parameters, FLOPs
and bytes; the totals; the stages and both allocations; --json with stable keys; and --html, one
self-contained page rendered headless in Chromium (Playwright) with a group per stage in the graph
and a bar per allocated tensor in the live-range charts."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile

import numpy as np
import onnx
import pytest
from onnx import helper
from util import graph_model, rand, unsupported_node_model

from luisaml import planning, report, report_page, runtime
from luisaml.cli import main
from luisaml.errors import RunError

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
                        "outputs", "op_counts", "neighbour_maps", "unsupported", "nodes", "totals", "stages", "registers",
                        "buffers", "batch_kernel", "rows_kept", "host_steps", "profile", "tuning"}
    assert doc["host_steps"] == [] and doc["profile"] is None  # no --profile: nothing ran, no times
    assert doc["neighbour_maps"] == []  # (no sparse convolution)
    assert all(st["time_ms"] is None for st in doc["stages"])
    assert doc["schema"] == 1 and doc["model"] == "cnn.onnx" and doc["op_counts"]["Conv"] == 2
    assert set(doc["nodes"][0]) == {"name", "op_type", "domain", "inputs", "outputs", "stage", "role", "inlined_in",
                                    "params", "flops", "bytes", "note", "attrs", "inputs_info"}
    # attributes and input shapes as the ONNX model has them
    proto = onnx.load(cnn_path)
    nodes = {d["name"]: d for d in doc["nodes"]}
    for n in proto.graph.node:
        assert nodes[n.name]["attrs"] == {a.name: helper.get_attribute_value(a) for a in n.attribute}, n.name
    inits = {t.name: list(t.dims) for t in proto.graph.initializer}
    assert nodes["c1"]["inputs_info"] == [
        {"name": "x", "dtype": "float", "shape": ["N", 3, 8, 8], "constant": False},
        {"name": "w1", "dtype": "float", "shape": inits["w1"], "constant": True},
        {"name": "b1", "dtype": "float", "shape": inits["b1"], "constant": True}]
    assert set(doc["totals"]) == {"nodes", "params", "flops", "flops_unknown", "bytes", "weight_blob_bytes",
                                  "weight_tensors"}
    assert set(doc["stages"][0]) == {"index", "domain", "items", "batched", "out", "nodes", "epilogue", "inlined",
                                     "reads", "writes", "describe", "registers", "threads", "readback", "time_ms"}
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


EVIL = "</text></script><script>alert(1)</script><text>"


def _hostile_report() -> dict:
    """Return the report of a model whose node name is markup, with an attribute string that is too
    (as a crafted .lml's stored report could carry)."""
    rep = report.from_plan(runtime.analyze(_cnn(name_c1=EVIL)))
    node = next(d for d in rep["nodes"] if d["name"] == EVIL)
    node["attrs"]["note"] = "<img src=x onerror=alert(2)>" + EVIL
    return rep


def test_html_escapes_model_text():
    page = report.html(_hostile_report())
    # the page's two script elements are its own: the data (JSON, every '<' escaped) and the code
    assert page.count("<script") == 2 and page.count("</script") == 2
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "<img" not in page
    data = page[page.index("<script type=application/json id=report-data>"):]
    data = data[data.index(">") + 1:data.index("</script>")]
    assert "<" not in data and EVIL in json.loads(data)["nodes"][0]["name"]
    code = page[page.rindex("<script>") + len("<script>"):page.rindex("</script>")]
    assert code == report_page.SCRIPT  # no model text in the code
    digest = base64.b64encode(hashlib.sha256(code.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in page and "default-src 'none'" in page  # CSP: this script, no fetch
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
            scripts = page.locator("script").evaluate_all("ss => ss.map(s => [s.type, s.src])")
            assert scripts == [["application/json", ""], ["", ""]]  # the data and the page's own code: no src
            page.screenshot(path=SCREENSHOT, full_page=True)
        finally:
            browser.close()
    assert requests == [page_path.as_uri()]
    assert os.path.getsize(SCREENSHOT) > 10_000


def test_hostile_text_stays_text_in_chromium(tmp_path):
    """A name and an attribute that are markup neither run nor change the page: the details show them
    as written, no dialog opens, no script error."""
    sync_playwright, launch = _chromium()
    page_path = tmp_path / "hostile.html"
    page_path.write_text(report.html(_hostile_report()), encoding="utf-8")
    dialogs, errors = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(**launch)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(page_path.as_uri())
            assert page.locator("img").count() == 0 and page.locator("script").count() == 2
            nodes = page.locator("#graph g.node").evaluate_all("gs => gs.map(g => g.dataset.node)")
            assert EVIL in nodes
            page.locator("#nodes tr[data-node]").first.click()  # the Conv named EVIL
            details = page.locator("#details")
            assert details.is_visible()
            assert details.locator("h3").text_content() == f"Conv {EVIL}"
            assert "<img src=x onerror=alert(2)>" + EVIL in details.inner_text()
            page.fill("#search", "alert(1)")
            assert page.locator("#graph g.node.hit").count() == 1
        finally:
            browser.close()
    assert dialogs == [] and errors == []


def test_attribute_values_are_data_of_bounded_size():
    from luisaml.model import Graph, Node

    big = np.arange(1000, dtype=np.float32).reshape(10, 100) - 7
    v = report.attribute_value(big)
    assert v.startswith("float32[10, 100]: -7, -6, -5") and "1,000 values" in v
    assert f"min {big.min():g}" in v and f"max {big.max():g}" in v and len(v) < 120
    assert report.attribute_value(np.array([1.5, 2], np.float32)) == "float32[2] = [1.5, 2]"
    assert report.attribute_value(list(range(16))) == list(range(16))  # short lists as they are
    longer = report.attribute_value(list(range(-3, 97)))
    assert longer.startswith("list int64[100]: -3, -2") and "min -3, max 96" in longer
    assert [report.attribute_value(x) for x in (float("inf"), float("-inf"), float("nan"))] == ["inf", "-inf", "nan"]
    assert report.attribute_value("x" * 5000).endswith("… (5,000 characters)")
    body = Graph("then_branch", [Node("n", "Relu", "", ["a"], ["b"])], ["a"], ["b"], {})
    assert report.attribute_value(body) == "graph 'then_branch': 1 node, inputs a, outputs b"
    json.dumps({"v": [report.attribute_value(x) for x in (big, float("nan"), body)]}, allow_nan=False)


def test_profile_times_must_be_of_the_reported_stages():
    rep = report.from_plan(runtime.analyze(_cnn()))
    lines = [st["describe"] for st in rep["stages"]]
    timed = report.with_profile(rep, [(line, 0.5 + k) for k, line in enumerate(lines)], backend="cpu", batch=1,
                                repeat=3)
    assert [st["time_ms"] for st in timed["stages"]] == [0.5 + k for k in range(len(lines))]
    assert timed["profile"]["total_ms"] == sum(0.5 + k for k in range(len(lines)))
    assert rep["profile"] is None and rep["stages"][0]["time_ms"] is None  # the report given is left as it was
    assert f"{0.5:9.3f} ms" in report.text(timed) and "data-ms=" in report.html(timed)
    with pytest.raises(RunError, match="first differ at stage 1"):
        report.with_profile(rep, [(lines[0], 1.0), ("stage 1 something else", 1.0)], backend="cpu", batch=1, repeat=1)
