"""Names: code injection through model names, and names that collide once made identifiers.

luisaml writes a Python module from the model and imports it, so every name that reaches that
module is a way in. A payload here is a name built from a line break (every character
str.splitlines() breaks on, Python's tokenizer only on \\n and \\r) and Python code that would
create the case's marker file; it is put at one place in a model (graph, node, If branch, tensor,
initializer, the file name ...) and the model goes through one action (compile + run,
NetworkInstance, the CLI in-process, `luisaml emit`, the real `luisaml` process). The case passes
when no marker appears, the generated source holds no code from the name, and the action either
gives the right outputs (numpy reference) or raises a luisaml error naming the name.

Other names: Python keywords and builtins, names of the generated module's own globals, very long
names, quotes and template syntax (singles); and pairs that are different ONNX names but the same
Python identifier ('a.b' and 'a_b', NFKC-equal 'ﬁ' and 'fi'), which must not alias.
"""
from __future__ import annotations

import os

import numpy as np
from onnx import helper

from .. import actions
from ..harness import FAIL_HARNESS, Case, Fail, attempt, judge, recipe
from ..models import BOOL, F, make_model, save, vi

BREAKS = {
    "lf": "\n", "cr": "\r", "crlf": "\r\n", "vt": "\x0b", "ff": "\x0c", "fs": "\x1c", "gs": "\x1d", "rs": "\x1e",
    "nel": "\x85", "ls": "\u2028", "ps": "\u2029",
}


def payload(variant: str, brk: str, marker: str) -> str:
    """Return a name that runs `touch(marker)` if a line break in it ends a line of generated code."""
    touch = f"__import__('pathlib').Path({marker!r}).touch()"
    return {
        # a statement of its own at module level (a comment line ends, code follows)
        "stmt": f"{brk}import pathlib;pathlib.Path({marker!r}).touch(){brk}#",
        # inside a function body: the statement keeps the body's indentation
        "indent4": f"x{brk}    {touch}{brk}    #",
        # inside a single-quoted string literal
        "quote": f"'{brk}{touch}#'",
        # inside a docstring
        "docstring": f'"""{brk}{touch}{brk}"""',
    }[variant]


VARIANTS = ("stmt", "indent4", "quote", "docstring")

# where a name goes: the names model's keyword argument
LOCATIONS = ("graph", "node", "if_node", "branch_node", "branch_graph", "input", "output", "intermediate",
             "initializer", "branch_output", "doc_string", "file_name")
DEFAULTS = {"graph": "names", "node": "mm", "if_node": "branch", "branch_node": "then_add", "branch_graph": "then_g",
            "input": "x", "output": "y", "intermediate": "t", "initializer": "W", "branch_output": "ty",
            "doc_string": "", "file_name": "model"}
W = np.random.default_rng(5).uniform(-1, 1, (4, 4)).astype(np.float32)


def names_model(**names: str):
    """Return (model, feeds, reference, file name) of x[N,4] @ W -> If(c: +1, else -1) -> y, with
    the given names at their places."""
    n = {**DEFAULTS, **names}
    then_g = helper.make_graph([helper.make_node("Add", [n["intermediate"], "one"], [n["branch_output"]],
                                                 name=n["branch_node"])], n["branch_graph"], [],
                              [vi(n["branch_output"], F, None)])
    else_g = helper.make_graph([helper.make_node("Sub", [n["intermediate"], "one"], ["ey"], name="else_sub")],
                               "else_g", [], [vi("ey", F, None)])
    nodes = [helper.make_node("MatMul", [n["input"], n["initializer"]], [n["intermediate"]], name=n["node"],
                              doc_string=n["doc_string"]),
             helper.make_node("If", ["c"], [n["output"]], name=n["if_node"], then_branch=then_g, else_branch=else_g)]
    model = make_model(nodes, [vi(n["input"], F, ["N", 4]), vi("c", BOOL, [])], [vi(n["output"], F, ["N", 4])],
                       {n["initializer"]: W, "one": np.array(1.0, np.float32)}, name=n["graph"], infer=False)
    x = np.random.default_rng(0).uniform(-2, 2, (3, 4)).astype(np.float32)
    feeds = {n["input"]: x, "c": np.array(True)}
    reference = {n["output"]: (x @ W + 1).astype(np.float32)}
    return model, feeds, reference, n["file_name"]


def run_action(ctx, action: str, model, feeds, reference, file_name: str, offender) -> None:
    """Save the model under file_name in the case folder and judge one action on it."""
    os.chdir(ctx.dir)  # a payload in the file name touches a relative marker: the case folder's
    try:
        path = save(model, ctx.dir / f"{file_name}.onnx")
    except OSError as e:  # a name no file system accepts: nothing to test through a file
        raise Fail(FAIL_HARNESS, f"cannot write the model file: {e}") from None
    outputs = [o.name for o in model.graph.output]
    if action == "compile":
        judge(attempt(actions.compile_run, path, feeds), offender=offender, reference=reference, rtol=1e-5, atol=1e-5)
    elif action == "instance":
        judge(attempt(actions.instance_run, path, feeds), offender=offender, reference=reference, rtol=1e-5, atol=1e-5)
    elif action == "cli":
        a = attempt(actions.cli_run, path, feeds, ctx.dir, outputs, offender)
        judge(a, offender=offender, reference=None if a.ok and a.value is None else reference, rtol=1e-5, atol=1e-5,
              what="luisaml run")
    elif action == "cli_process":
        argv = actions.cli_args_for(path, feeds, ctx.dir)
        res = actions.cli_subprocess(argv, cwd=ctx.dir)
        if res.code != 0:
            actions.judge_cli(res, offender)
        else:
            got = actions.cli_outputs(res, ctx.dir, outputs)
            judge(attempt(lambda: got), reference=reference, rtol=1e-5, atol=1e-5, what="luisaml run (process)")
    elif action == "emit":
        a = attempt(actions.cli_inprocess, ["emit", path])
        judge(a, offender=offender)
        if a.value.code == 0:
            actions.check_source(a.value.stdout)
        else:
            actions.judge_cli(a.value, offender)
    else:
        raise Fail(FAIL_HARNESS, f"unknown action {action!r}")


@recipe("names.inject")
def inject(ctx, location: str, brk: str, variant: str, action: str) -> None:
    # the file name's payload cannot hold '/': it touches the marker relative to the case folder
    marker = "INJECTED" if location == "file_name" else ctx.marker
    name = payload(variant, BREAKS[brk], marker)
    model, feeds, ref, file_name = names_model(**{location: name})
    run_action(ctx, action, model, feeds, ref, file_name, offender=name)


# ---- odd names, one at a time --------------------------------------------------------------------

SINGLES = {
    **{f"kw_{k}": k for k in ("def", "class", "lambda", "import", "None", "True", "yield", "await", "match", "_",
                               "nonlocal", "pass")},
    **{f"global_{k}": k for k in ("luisa", "forward", "batch_kernel", "weights", "INF", "NAN", "int", "float",
                                   "range", "__import__", "Arr_float_4", "sample", "dispatch_id", "__name__",
                                   "__builtins__", "x_x", "y_y", "s1", "i4", "v2")},
    "digits": "123", "float_literal": "1e5", "negative": "-1", "space": " ", "tab": "\t", "dot": ".",
    "single_quote": "'", "double_quote": '"', "triple_quote": '"""', "backslash": "\\", "backslash_n": "\\n",
    "jinja_expr": "{{ 7*7 }}", "jinja_stmt": "{% for i in range(3) %}x{% endfor %}", "jinja_comment": "{#",
    "format": "{0}{name}%s", "path": "../../x/y", "unicode_cjk": "名前", "emoji": "🙂", "nul": "a\x00b",
    "rtl": "\u202eabc", "zero_width": "a\u200bb", "combining": "e\u0301", "long_1k": "n" * 1000,
    "long_100k": "m" * 100_000, "long_unicode": "é" * 5000,
}
SINGLE_LOCATIONS = ("input", "output", "intermediate", "initializer", "node", "graph", "branch_output", "file_name")


def _file_name_ok(name: str) -> bool:
    return "/" not in name and "\x00" not in name and len(name.encode()) < 200 and name not in (".", "..")


@recipe("names.single")
def single(ctx, location: str, key: str, action: str) -> None:
    name = SINGLES[key]
    model, feeds, ref, file_name = names_model(**{location: name})
    run_action(ctx, action, model, feeds, ref, file_name, offender=name)


# ---- pairs: two names, one identifier ------------------------------------------------------------

PAIRS = {
    "dot_underscore": ("a.b", "a_b"), "dash_underscore": ("a-b", "a_b"), "space_underscore": ("a b", "a_b"),
    "nfkc_fi": ("\ufb01", "fi"), "nfkc_fraktur_h": ("\u210c", "H"), "nfkc_superscript": ("x\u00b2", "x2"),
    "nfkc_roman": ("\u2168", "IX"), "nfkc_fullwidth": ("\uff58", "x"), "cr_lf": ("a\rb", "a\nb"),
    "slash_underscore": ("a/b", "a_b"), "colon_underscore": ("a::b", "a__b"),
    "long_prefix": ("p" * 70 + "1", "p" * 70 + "2"), "case": ("A", "a"),
}
PAIR_LOCATIONS = ("inputs", "outputs", "intermediates", "initializers", "input_output")


def pair_model(location: str, a: str, b: str):
    """Return (model, feeds, reference) of a model where names a and b name two different tensors."""
    rng = np.random.default_rng(11)
    x1 = rng.uniform(-2, 2, (3, 4)).astype(np.float32)
    x2 = rng.uniform(-2, 2, (3, 4)).astype(np.float32)
    w1 = rng.uniform(-1, 1, (4, 4)).astype(np.float32)
    w2 = rng.uniform(-1, 1, (4, 4)).astype(np.float32)
    i1, i2, o1, o2, t1, t2, k1, k2 = "in1", "in2", "out1", "out2", "t1", "t2", "w1", "w2"
    if location == "inputs":
        i1, i2 = a, b
    elif location == "outputs":
        o1, o2 = a, b
    elif location == "intermediates":
        t1, t2 = a, b
    elif location == "initializers":
        k1, k2 = a, b
    elif location == "input_output":
        i1, o1 = a, b
    nodes = [helper.make_node("MatMul", [i1, k1], [t1], name="mm1"),
             helper.make_node("MatMul", [i2, k2], [t2], name="mm2"),
             helper.make_node("Sub", [t1, t2], [o1], name="sub"),
             helper.make_node("Mul", [t1, t2], [o2], name="mul")]
    model = make_model(nodes, [vi(i1, F, ["N", 4]), vi(i2, F, ["N", 4])], [vi(o1, F, ["N", 4]), vi(o2, F, ["N", 4])],
                       {k1: w1, k2: w2}, name="pairs", infer=False)
    t1v, t2v = x1 @ w1, x2 @ w2
    return model, {i1: x1, i2: x2}, {o1: (t1v - t2v).astype(np.float32), o2: (t1v * t2v).astype(np.float32)}


@recipe("names.pair")
def pair(ctx, location: str, key: str, action: str) -> None:
    a, b = PAIRS[key]
    model, feeds, ref = pair_model(location, a, b)
    run_action(ctx, action, model, feeds, ref, "pairs", offender=(a, b))


# ---- the catalog ----------------------------------------------------------------------------------

# what the outside probe found: these run in every CI sample
_CI_INJECT = {("graph", "cr", "stmt", "compile"), ("node", "cr", "indent4", "compile"),
              ("branch_node", "cr", "indent4", "compile"), ("input", "cr", "stmt", "compile"),
              ("file_name", "cr", "stmt", "cli"), ("node", "ls", "indent4", "instance"),
              ("graph", "nel", "stmt", "emit"), ("intermediate", "crlf", "stmt", "compile")}
_CI_PAIRS = {("dot_underscore", "inputs"), ("nfkc_fi", "inputs"), ("nfkc_fraktur_h", "outputs"), ("cr_lf", "inputs")}
_CI_SINGLES = {("kw_def", "input"), ("long_100k", "node"), ("global_weights", "input"), ("jinja_expr", "graph")}


def cases() -> list[Case]:
    out = []
    for location in LOCATIONS:
        for brk in BREAKS:
            for variant in VARIANTS:
                acts = ["compile"]
                if variant == "stmt":
                    acts += ["instance", "cli"]
                if variant in ("indent4", "quote"):
                    acts += ["emit"]
                for action in acts:
                    out.append(Case(f"names/inject/{location}/{brk}/{variant}/{action}", "names", "names.inject",
                                    dict(location=location, brk=brk, variant=variant, action=action),
                                    ci=(location, brk, variant, action) in _CI_INJECT))
    # the real `luisaml` process, for the places a name reaches the CLI's own messages
    for location in ("file_name", "graph", "input"):
        out.append(Case(f"names/inject/{location}/cr/stmt/cli_process", "names", "names.inject",
                        dict(location=location, brk="cr", variant="stmt", action="cli_process"), timeout=150))
    for key, name in SINGLES.items():
        for location in SINGLE_LOCATIONS:
            if location == "file_name" and not _file_name_ok(name):
                continue
            out.append(Case(f"names/single/{key}/{location}", "names", "names.single",
                            dict(location=location, key=key, action="compile"), ci=(key, location) in _CI_SINGLES))
    for key in PAIRS:
        for location in PAIR_LOCATIONS:
            out.append(Case(f"names/pair/{key}/{location}", "names", "names.pair",
                            dict(location=location, key=key, action="compile"), ci=(key, location) in _CI_PAIRS))
        out.append(Case(f"names/pair/{key}/inputs/instance", "names", "names.pair",
                        dict(location="inputs", key=key, action="instance")))
    return out
