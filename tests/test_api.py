"""The typed public API: a docstring on every public name, every keyword of `luisaml.compile`
described in its docstring and in README.md's "Use" section (so the README cannot drift from the
code), Literal types for the string options, py.typed shipped, and `import luisaml` without torch."""
from __future__ import annotations

import inspect
import pathlib
import re
import subprocess
import sys
import typing

import tomllib

import luisaml
from luisaml import runtime

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_public_name_has_a_docstring():
    missing = [n for n in luisaml.__all__ if not (inspect.getdoc(getattr(luisaml, n)) or "").strip()]
    assert not missing, f"no docstring: {missing}"
    # the public methods of the classes users hold
    for cls in (luisaml.CompiledNetwork, luisaml.PerBatchNetwork, luisaml.NetworkInstance, luisaml.InferenceSession,
                luisaml.Limits, luisaml.CompileOptions):
        for name, member in vars(cls).items():
            if name.startswith("_"):
                continue
            fn = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
            if callable(fn) or isinstance(member, property):
                assert (fn.__doc__ or "").strip(), f"{cls.__name__}.{name} has no docstring"


def _undocumented(module) -> list[str]:
    """Return the public functions, classes, methods and properties defined in `module` that have
    no docstring."""
    missing = []
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        if not (inspect.getdoc(obj) or "").strip():
            missing.append(name)
        if inspect.isclass(obj):
            for k, member in vars(obj).items():
                fn = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                if k.startswith("_") or inspect.isclass(fn) or not (callable(fn) or isinstance(member, property)):
                    continue
                if not (fn.__doc__ or "").strip():
                    missing.append(f"{name}.{k}")
    return missing


def test_every_public_function_of_the_user_facing_modules_has_a_docstring():
    import importlib

    for name in ("luisaml.runtime", "luisaml.session", "luisaml.artifact", "luisaml.torch", "luisaml.report",
                 "luisaml.log", "luisaml.cache", "luisaml.cli", "luisaml.limits", "luisaml.errors"):
        module = importlib.import_module(name)
        assert (module.__doc__ or "").strip(), f"{name} has no module docstring"
        assert not _undocumented(module), f"{name}: no docstring on {_undocumented(module)}"


def _use_section() -> str:
    """README.md's "Use" section up to its first subsection: where compile's keywords are listed."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("\n## Use\n")
    return text[start: text.index("\n### ", start)]


def test_every_keyword_of_compile_is_described_in_its_docstring_and_the_readme():
    keywords = list(inspect.signature(luisaml.compile).parameters)
    assert {"model", "weights", "backend", "batch_axis", "schedule"} <= set(keywords)
    doc = inspect.getdoc(luisaml.compile)
    use = _use_section()
    for k in keywords:
        assert re.search(rf"^{k}: \S", doc, re.MULTILINE), f"compile's docstring does not describe '{k}' ('{k}: ...')"
        assert re.search(rf"^- `{k}`: \S", use, re.MULTILINE), f"README.md's Use section does not describe '{k}'"
    # and nothing the README describes is gone from the signature
    described = re.findall(r"^- `(\w+)`: ", use, re.MULTILINE)
    assert set(described) <= set(keywords), set(described) - set(keywords)


def _values(hint) -> set:
    """Return the values a Literal (or a Union of Literals and None) allows."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        return set(args)
    return set().union(*(_values(a) for a in args)) if args else {None if hint is type(None) else hint}


def test_string_options_are_literal_types():
    hints = typing.get_type_hints(luisaml.compile)
    assert _values(hints["backend"]) == {"auto", "cpu", "cuda"}
    assert _values(hints["precision"]) == {"fp32", "fp16"}
    assert _values(hints["float64"]) == {"reject", "float32"}
    assert _values(hints["schedule"]) == {"auto", "stages", "per-sample"}
    assert _values(hints["batch_axis"]) == {"auto", 0, None}
    analyze = typing.get_type_hints(runtime.analyze)  # analyze takes the same ones
    assert all(analyze[k] == hints[k] for k in ("precision", "float64", "schedule", "batch_axis"))
    # what the types allow is what CompileOptions.check accepts
    for key in ("float64", "schedule", "batch_axis"):
        for v in _values(hints[key]):
            runtime.CompileOptions(**{key: v}).check()


def test_py_typed_ships_with_the_package():
    assert (ROOT / "luisaml" / "py.typed").is_file()
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in data["luisaml"]


def test_import_luisaml_leaves_torch_alone_until_luisaml_torch():
    code = ("import sys, luisaml; assert 'torch' not in sys.modules; "
            "from luisaml import InferenceSession; f = luisaml.torch.compile; "
            "assert 'torch' in sys.modules and f.__module__ == 'luisaml.torch'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
