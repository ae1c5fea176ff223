"""The luisaml actions a case can take on a model, each returning outputs by name (or raising):
compile + run, the NetworkInstance API, the `luisaml` CLI (in-process or as its own process), and
`emit`; plus the static check that generated source holds no smuggled code."""
from __future__ import annotations

import ast
import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Mapping

import numpy as np

from .harness import FAIL_ABORT, FAIL_ERROR, FAIL_INJECTION, Fail, names_offender, short

ACTIONS = ("compile", "instance", "cli")


def compile_run(model, feeds: Mapping[str, np.ndarray], weights=None, **options) -> dict:
    """luisaml.compile + run; the generated source is checked for smuggled code first."""
    import luisaml

    net = luisaml.compile(model, weights, **options)
    check_source(net.source)
    return net.run(dict(feeds))


def instance_run(model, feeds: Mapping[str, np.ndarray], weights=None, **options) -> dict:
    """The C++-style API: NetworkInstance(model) / set_input / forward."""
    import luisaml

    inst = luisaml.NetworkInstance(model, weights, **options)
    check_source(inst.net.source)
    for k, v in feeds.items():
        inst.set_input(k, v)
    return inst.forward()


class CliResult:
    def __init__(self, code: int, stdout: str, stderr: str):
        self.code, self.stdout, self.stderr = code, stdout, stderr


def cli_inprocess(argv: list[str]) -> CliResult:
    """Run luisaml.cli.main(argv) here, capturing its output. An exception that escapes main() is
    a traceback on a user's terminal: that is FAIL_ERROR whatever it is."""
    from luisaml import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse, or a `raise SystemExit(message)`
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except Exception as e:  # noqa: BLE001
            raise Fail(FAIL_ERROR, f"luisaml {argv[0]}: {type(e).__module__}.{type(e).__qualname__} escaped "
                                   f"luisaml.cli.main (a traceback for the user): {short(str(e))}") from None
    return CliResult(code or 0, out.getvalue(), err.getvalue())


def cli_subprocess(argv: list[str], cwd: str | os.PathLike, timeout: float = 120, env=None) -> CliResult:
    """Run `python -m luisaml.cli ARGV` as its own process (the `luisaml` entry point's code)."""
    p = subprocess.run([sys.executable, "-m", "luisaml.cli", *argv], cwd=cwd, capture_output=True, timeout=timeout,
                       env=env)
    if p.returncode < 0:
        raise Fail(FAIL_ABORT, f"the luisaml CLI died by signal {-p.returncode}: {short(p.stderr.decode('utf-8', 'replace')[-500:])}")
    return CliResult(p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace"))


def cli_args_for(model_path: str, feeds: Mapping[str, np.ndarray], folder: Path, extra=()) -> list[str]:
    """Return `run MODEL --input NAME=FILE.npy ... --out DIR` with the feeds saved in folder."""
    argv = ["run", model_path, "--backend", "cpu", "--out", str(folder / "out"), *extra]
    for k, (name, v) in enumerate(feeds.items()):
        path = folder / f"in{k}.npy"
        np.save(path, v)
        argv += ["--input", f"{name}={path}"]
    return argv


def cli_outputs(res: CliResult, folder: Path, names) -> dict:
    """Return the outputs a successful `luisaml run --out` wrote, by output name."""
    out = {}
    for name in names:
        path = folder / "out" / f"{name.replace('/', '_')}.npy"
        if path.exists():
            out[name] = np.load(path)
    return out


def judge_cli(res: CliResult, offender) -> None:
    """Raise Fail unless a failed CLI run printed exactly one line naming the offender."""
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    # notes for the user (a cast input, random inputs, a slow build) may precede the error line
    lines = [ln for ln in lines if not ln.startswith(("luisaml: note:", "random inputs for", "luisaml: compiled"))]
    if "Traceback (most recent call last)" in res.stderr or len(lines) != 1:
        raise Fail(FAIL_ERROR, f"the CLI exited {res.code} and printed {len(lines)} lines instead of one: "
                               f"{short(res.stderr[-400:])}")
    if offender is not None and not names_offender(lines[0], offender):
        raise Fail(FAIL_ERROR, f"the CLI's error does not name {short(ascii(offender), 60)}: {short(lines[0])}")


def cli_run(model_path: str, feeds: Mapping[str, np.ndarray], folder: Path, output_names, offender,
            weights: str | None = None) -> dict | None:
    """`luisaml run` in-process: return its outputs when it succeeded; raise Fail when it failed
    badly (a traceback, several lines, a message that does not name the offender); return None
    when it failed well."""
    extra = ["--weights", weights] if weights else []
    res = cli_inprocess(cli_args_for(model_path, feeds, folder, extra))
    if res.code == 0:
        return cli_outputs(res, folder, output_names)
    judge_cli(res, offender)
    return None


# ---- smuggled code -----------------------------------------------------------------------------

_SMUGGLED = {"pathlib", "__import__", "touch", "INJECTED"}


def smuggled_code(source: str) -> str | None:
    """Return what in a generated module is code a model name put there (the payloads of the names
    family all mention pathlib or __import__), or None. Comments and string literals may quote a
    name; only names, attributes, imports and calls count."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None  # not importable at all: luisaml's compile reports it
    for node in ast.walk(tree):
        hit = None
        if isinstance(node, ast.Name) and node.id in _SMUGGLED:
            hit = node.id
        elif isinstance(node, ast.Attribute) and node.attr in _SMUGGLED:
            hit = node.attr
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and any(a.name.split(".")[0] in _SMUGGLED
                                                                     for a in node.names):
            hit = "import"
        if hit:
            line = source.splitlines()[node.lineno - 1] if getattr(node, "lineno", 0) else ""
            return f"line {getattr(node, 'lineno', '?')}: {short(line.strip(), 120)}"
    return None


def check_source(source: str) -> None:
    found = smuggled_code(source)
    if found:
        raise Fail(FAIL_INJECTION, f"generated module holds code from a name ({found})")
