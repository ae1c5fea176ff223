"""The kernel builder: emitted lines with indentation, fresh names, the jinja2 environment over
shaders/, and the generated module written to a content-hashed file and imported from there."""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Iterator

import jinja2

from . import indexing
from .dtypes import DType
from .storage import Local, Tensor, literal

_ENV: jinja2.Environment | None = None


def template_env() -> jinja2.Environment:
    """Return the jinja2 environment over the shipped shaders/ templates."""
    global _ENV
    if _ENV is None:
        import luisaml.shaders as shaders

        _ENV = jinja2.Environment(
            loader=jinja2.FileSystemLoader(os.path.dirname(shaders.__file__)),
            trim_blocks=True,
            lstrip_blocks=True,
            keep_trailing_newline=False,
            undefined=jinja2.StrictUndefined,
            # compiled templates kept across processes: parsing mlp.py.j2 and friends is a tenth
            # of a cached compile otherwise
            bytecode_cache=_template_cache(),
        )
        _ENV.globals.update(ix=indexing, lit=literal)
    return _ENV


def _template_cache() -> jinja2.BytecodeCache | None:
    try:
        path = cache_dir().parent / "templates"
        path.mkdir(parents=True, exist_ok=True)
        return jinja2.FileSystemBytecodeCache(str(path))
    except OSError:  # a read-only home: templates are compiled in every process instead
        return None


def identifier(name: str, prefix: str) -> str:
    """Return a DSL-safe identifier derived from a tensor name."""
    s = re.sub(r"\W", "_", name)
    full = f"{prefix}_{s}"
    if len(full) <= 60:
        return full
    # long names often share their first 60 characters (onnx's expanded function tensors): keep
    # a hash of the whole name so that two of them never become the same parameter
    return f"{full[:51]}_{hashlib.sha256(name.encode()).hexdigest()[:8]}"


class Module:
    """What every function of one generated module shares: array types, helpers, names."""

    def __init__(self) -> None:
        self.array_types: dict[tuple[str, int], str] = {}
        self.helpers: dict[str, set[str]] = {}  # shaders module -> DSL functions imported from it
        self._counter = 0

    def fresh(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}{self._counter}"

    def imports(self) -> list[tuple[str, list[str]]]:
        """Return (shaders module, sorted names) of every helper import, sorted by module."""
        return [(m, sorted(names)) for m, names in sorted(self.helpers.items())]

    def array_type(self, dsl: str, n: int) -> str:
        """Return the module-level name of luisa.ArrayType(n, dsl), declaring it once."""
        key = (dsl, max(int(n), 1))
        if key not in self.array_types:
            self.array_types[key] = f"Arr_{dsl}_{key[1]}"
        return self.array_types[key]


class KernelContext:
    """Collects the lines of one function body; operators emit through it."""

    def __init__(self, module: Module, indent: int = 1) -> None:
        self.module = module
        self.out: list[str] = []
        self.level = indent

    # ---- lines ---------------------------------------------------------------------------
    def line(self, text: str) -> None:
        self.out.append("    " * self.level + text)

    def lines(self, text: str) -> None:
        """Emit a block of lines (e.g. a rendered template), keeping its relative indentation."""
        for raw in text.splitlines():
            if raw.strip():
                self.line(raw.rstrip())

    def comment(self, text: str) -> None:
        self.line("# " + text.replace("\n", " "))

    @contextlib.contextmanager
    def indent(self) -> Iterator[None]:
        self.level += 1
        try:
            yield
        finally:
            self.level -= 1

    @contextlib.contextmanager
    def loop(self, n: int, prefix: str = "i") -> Iterator[str]:
        """Emit `for v in range(n):` and yield v; a loop of one iteration yields "0" and no loop."""
        if n == 1:
            yield "0"
            return
        v = self.fresh(prefix)
        self.line(f"for {v} in range({n}):")
        with self.indent():
            yield v

    def fresh(self, prefix: str = "t") -> str:
        return self.module.fresh(prefix)

    def let(self, expr: str, prefix: str = "t") -> str:
        """Emit `v = expr` for a fresh v and return v (names and numbers are returned as they are)."""
        if expr.replace("_", "").isalnum():
            return expr
        v = self.fresh(prefix)
        self.line(f"{v} = {expr}")
        return v

    # ---- tensors ---------------------------------------------------------------------------
    def load(self, t: Tensor, i: str) -> str:
        return t.load(i)

    def store(self, t: Tensor, i: str, value: str) -> None:
        self.line(t.store(i, value))

    def lit(self, value, dtype: DType) -> str:
        return literal(value, dtype)

    def local_array(self, dsl: str, n: int, prefix: str = "a") -> str:
        """Declare a local array of n elements here and return its name."""
        name = self.fresh(prefix)
        self.line(f"{name} = {self.module.array_type(dsl, n)}()")
        return name

    def local_tensor(self, like: Tensor, prefix: str = "tmp") -> Tensor:
        """Declare a local array shaped like `like` and return a Tensor stored in it."""
        name = self.local_array(like.dtype.dsl, like.numel, prefix)
        return Tensor(name, like.dtype, like.shape, like.batched, None, Local(name))

    def use_helper(self, name: str, module: str = "dsl_lib") -> str:
        """Import a DSL function from luisaml.shaders.<module> into the module; return its name."""
        self.module.helpers.setdefault(module, set()).add(name)
        return name

    def render(self, template: str, **values) -> None:
        """Render a template from shaders/ with `values` and emit it here."""
        self.lines(template_env().get_template(template).render(ctx=self, **values))


# ---- the module file ---------------------------------------------------------------------------


def render_module(**values) -> str:
    """Return the source of a generated module (shaders/module.py.j2)."""
    return template_env().get_template("module.py.j2").render(**values) + "\n"


def cache_dir() -> Path:
    """Return the folder generated modules are written to (LUISAML_CACHE overrides)."""
    root = os.environ.get("LUISAML_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "luisaml"
    )
    path = Path(root) / "generated"
    path.mkdir(parents=True, exist_ok=True)
    return path


def digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:20]


def write_module(source: str) -> Path:
    """Write source to a file named by its content hash (atomically) and return the path."""
    path = cache_dir() / f"net_{digest(source)}.py"
    if not path.exists() or path.read_text() != source:
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(source)
        os.replace(tmp, path)
    return path


def import_module(path: Path):
    """Import a generated module from its file (once per process)."""
    name = f"luisaml_generated.{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
