"""`luisaml inspect --html --profile` on a 300-node model, rendered headless in Chromium (Playwright):
each stage's time in its row and on its box, the search box, a node's attributes on click, zoom
and pan of the graph, no cell whose content overflows it, a screenshot that is not blank; and no
times (nothing run) without --profile."""
from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import onnx
import pytest
from onnx import helper
from test_report import _chromium
from util import graph_model, rand

from luisaml import network, runtime
from luisaml.cli import main

LONG = "tanh_" + "very_long_name_" * 14 + "without_spaces"  # wider than any cell: it must wrap
_UNARY = ("Tanh", "Add", "Sin", "Mul", "Abs", "Neg", "Cos", "Erf")  # no op that reads its input twice


def _chain300() -> onnx.ModelProto:
    """x[N,16] -> 12 x (MatMul or Gemm(transB=1, alpha=0.5), then 24 elementwise ops) -> Softmax: 301 nodes,
    13 stages; one node named LONG."""
    nodes, inits, x, k = [], {}, "x", 0
    for block in range(12):
        inits[f"w{block}"] = rand((16, 16), seed=block) * 0.3
        if block % 2:
            nodes.append(helper.make_node("Gemm", [x, f"w{block}"], [f"mm{block}"], name=f"gemm_{block}", transB=1,
                                          alpha=0.5))
        else:
            nodes.append(helper.make_node("MatMul", [x, f"w{block}"], [f"mm{block}"], name=f"matmul_{block}"))
        x = f"mm{block}"
        for j in range(24):
            op = _UNARY[(block + j) % len(_UNARY)]
            ins = [x]
            if op in ("Add", "Mul"):
                inits[f"c{k}"] = rand((16,), seed=100 + k)
                ins.append(f"c{k}")
            name = LONG if (block, j) == (5, 3) else f"{op.lower()}_{block}_{j}"
            nodes.append(helper.make_node(op, ins, [f"t{k}"], name=name))
            x, k = f"t{k}", k + 1
    nodes.append(helper.make_node("Softmax", [x], ["y"], name="softmax", axis=-1))
    return graph_model(nodes, {"x": rand((2, 16))}, inits, opset=17, batch="N")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(the model's path, its proto, the folder for pages)."""
    folder = tmp_path_factory.mktemp("report_page")
    proto = _chain300()
    assert len(proto.graph.node) == 301
    path = folder / "chain300.onnx"
    onnx.save(proto, path)
    return str(path), proto, folder


@pytest.fixture(scope="module")
def profiled(model):
    """(the page's path, the JSON report) of `inspect --html --profile --json`."""
    path, _, folder = model
    page = folder / "profiled.html"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["inspect", path, "--html", str(page), "--profile", "--json"]) == 0
    return page, json.loads(out.getvalue())


def test_profile_times_every_stage(model, profiled):
    path, _, _ = model
    _, doc = profiled
    plan = runtime.analyze(path)
    assert [st["describe"] for st in doc["stages"]] == [st.describe() for st in plan.schedule.stages]
    times = [st["time_ms"] for st in doc["stages"]]
    assert all(isinstance(ms, float) and ms > 0 for ms in times)
    prof = doc["profile"]
    assert prof["backend"] == "cpu" and prof["batch"] == 1 and prof["repeat"] == 5
    assert prof["total_ms"] == pytest.approx(sum(times))


def test_without_profile_nothing_runs_and_no_times(model, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("inspect without --profile ran the network")

    monkeypatch.setattr(network.CompiledNetwork, "run", refuse)
    monkeypatch.setattr(network.CompiledNetwork, "profile", refuse)
    path, _, folder = model
    page = folder / "plain.html"
    assert main(["inspect", path, "--html", str(page), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["profile"] is None and all(st["time_ms"] is None for st in doc["stages"])
    html = page.read_text(encoding="utf-8")
    assert "data-ms=" not in html and "class=time" not in html and "<th>time</th>" not in html


def _view_box(page) -> list[float]:
    return [float(v) for v in page.locator("#graph").get_attribute("viewBox").split()]


def test_the_page_in_chromium(model, profiled):
    sync_playwright, launch = _chromium()
    _, proto, _ = model
    page_path, doc = profiled
    requests, errors = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(**launch)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})

            def route(r):  # the page works offline: nothing but itself is fetched
                requests.append(r.request.url)
                r.continue_() if r.request.url.startswith("file://") else r.abort()

            page.route("**/*", route)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(page_path.as_uri())

            # every stage row and every stage box has its time
            rows = page.locator("#stages tr[data-stage]")
            assert rows.count() == len(doc["stages"])
            shown = rows.locator("td[data-ms]").evaluate_all("tds => tds.map(td => [+td.dataset.ms, td.innerText])")
            assert [round(ms, 6) for ms, _ in shown] == [round(st["time_ms"], 6) for st in doc["stages"]]
            assert all(" ms" in text and "%" in text for _, text in shown)
            assert page.locator("#graph g.stage text.time").count() == len(doc["stages"])

            # a node per graph line: the search box highlights those whose name or op type holds the text
            assert page.locator("#graph g.node").count() == len(proto.graph.node)
            line = page.locator(f"#graph g.node[data-node='{LONG}']")  # too long for the widest box:
            assert LONG not in line.locator("text").first.text_content()  # cut on the line,
            assert LONG in line.locator("title").text_content()  # whole in its tooltip
            page.fill("#search", "gemm")
            want = [n.name for n in proto.graph.node if "gemm" in n.name.lower() or "gemm" in n.op_type.lower()]
            assert page.locator("#graph g.node.hit").count() == len(want) == 6
            assert page.locator("#nodes tr[data-node]:visible").count() == len(want)
            assert page.locator("#stages tr[data-stage]:visible").count() == len(want)
            assert page.locator("#search-count").text_content().startswith("6 nodes in 6 stages")
            page.fill("#search", "add_3_14")
            assert page.locator("#graph g.node.hit").evaluate_all("gs => gs.map(g => g.dataset.node)") == ["add_3_14"]
            page.fill("#search", "Erf")
            assert page.locator("#graph g.node.hit").count() == sum(n.op_type == "Erf" for n in proto.graph.node)

            # Enter brings the next hit into the view; clicking it shows its attributes and inputs' shapes
            page.fill("#search", "gemm_7")
            page.press("#search", "Enter")
            node = page.locator("#graph g.node[data-node='gemm_7']")
            view, bb = page.locator(".zoomview[data-view=graph]").bounding_box(), node.bounding_box()
            assert view["y"] <= bb["y"] and bb["y"] + bb["height"] <= view["y"] + view["height"]
            page.locator("#details .close").click()
            assert page.locator("#details").is_hidden()
            node.click()
            details = page.locator("#details")
            assert details.is_visible() and details.locator("h3").text_content() == "Gemm gemm_7"
            pairs = dict(zip(details.locator("dt").all_text_contents(), details.locator("dd").all_text_contents()))
            gemm = next(n for n in proto.graph.node if n.name == "gemm_7")
            assert len(gemm.attribute) == 2  # alpha 0.5, transB 1
            assert {k[1:]: v for k, v in pairs.items() if k.startswith("@")} == {
                a.name: str(helper.get_attribute_value(a)) for a in gemm.attribute}
            assert pairs["input 1"] == "w7: float[16, 16] (constant)" and pairs["output 0"] == "mm7: float[N, 16]"
            assert pairs["runs"] == f"stage {next(d['stage'] for d in doc['nodes'] if d['name'] == 'gemm_7')}, root"
            page.fill("#search", "")

            # zoom: the buttons and ctrl+wheel scale the graph's viewBox; a drag pans it
            page.click(".zoombox:has(#graph) button[data-zoom=width]")
            x, y, w, h = _view_box(page)
            page.click(".zoombox:has(#graph) button[data-zoom=in]")
            x2, y2, w2, h2 = _view_box(page)
            assert w2 == pytest.approx(w / 1.25, rel=1e-3) and h2 == pytest.approx(h / 1.25, rel=1e-3)
            page.evaluate("() => window.scrollBy(0, document.querySelector('.zoomview').getBoundingClientRect().top - 60)")
            view = page.locator(".zoomview[data-view=graph]").bounding_box()
            assert 0 < view["y"] and view["y"] + 400 < 900  # what the mouse does below lands in the view
            page.mouse.move(view["x"] + 200, view["y"] + 200)
            page.keyboard.down("Control")
            page.mouse.wheel(0, 300)  # out
            page.keyboard.up("Control")
            page.wait_for_function(f"document.querySelector('#graph').getAttribute('viewBox').split(' ')[2] > {w2 + 1}")
            before = _view_box(page)
            page.mouse.move(view["x"] + 300, view["y"] + 400)
            page.mouse.down()
            page.mouse.move(view["x"] + 300, view["y"] + 100, steps=5)
            page.mouse.up()
            after = _view_box(page)
            assert after[1] > before[1] and after[2:] == before[2:]  # dragged up: the view moved down the graph

            # nothing overflows its cell: long names wrap (or scroll down inside the cell)
            over = page.evaluate("() => Array.from(document.querySelectorAll('td')).filter("
                                 "td => td.scrollWidth > td.clientWidth + 1).map(td => td.textContent.slice(0, 80))")
            assert over == []
            wide = page.evaluate("() => Array.from(document.querySelectorAll('.scroll')).filter("
                                 "d => d.scrollWidth > d.clientWidth + 1).map(d => d.firstElementChild.id)")
            assert wide == []  # no table wider than the page: its last columns (reads, writes) in sight
            reads = page.locator("#stages tr[data-stage] td:nth-last-child(2)")
            assert all(0 < bb["x"] and bb["x"] + bb["width"] <= 1280 for bb in
                       (reads.nth(k).bounding_box() for k in range(reads.count())))
            long_row = page.locator(f"#nodes tr[data-node='{LONG}'] td").first
            assert long_row.bounding_box()["height"] > 30  # wrapped onto several lines

            shot = page.screenshot(full_page=False)
        finally:
            browser.close()
    assert errors == [] and requests == [page_path.as_uri()]
    # the screenshot is not blank: many colours, pixels that vary
    Image = pytest.importorskip("PIL.Image", reason="Pillow is not installed")
    pixels = np.asarray(Image.open(io.BytesIO(shot)).convert("RGB"))
    assert pixels.shape[:2] == (900, 1280)
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50 and pixels.std() > 20


def test_list_attributes_in_the_details(tmp_path):
    """A Conv's pads, strides and kernel_shape as the ONNX model writes them."""
    sync_playwright, launch = _chromium()
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 0, 1, 0], strides=[2, 1],
                            kernel_shape=[3, 3], group=1)
    path = tmp_path / "conv.onnx"
    proto = graph_model([node], {"x": rand((2, 3, 8, 8))}, {"w": rand((4, 3, 3, 3))}, opset=17, batch="N")
    onnx.save(proto, path)
    dims = [d.dim_param or d.dim_value for d in proto.graph.output[0].type.tensor_type.shape.dim]  # onnx's inference
    page_path = tmp_path / "conv.html"
    assert main(["inspect", str(path), "--html", str(page_path)]) == 0
    with sync_playwright() as p:
        browser = p.chromium.launch(**launch)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.goto(page_path.as_uri())
            page.locator("#graph g.node[data-node='conv']").click()
            details = page.locator("#details")
            pairs = dict(zip(details.locator("dt").all_text_contents(), details.locator("dd").all_text_contents()))
        finally:
            browser.close()
    assert {k[1:]: v for k, v in pairs.items() if k.startswith("@")} == {
        a.name: str(helper.get_attribute_value(a)) for a in node.attribute}
    assert pairs["input 1"] == "w: float[4, 3, 3, 3] (constant)" and pairs["output 0"] == f"y: float[{', '.join(map(str, dims))}]"
