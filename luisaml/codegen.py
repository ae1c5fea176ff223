"""The kernel builder: emitted lines with indentation, fresh names, the jinja2 environment over
shaders/, and the generated module written to a content-hashed file and imported from there."""
from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Iterator

import jinja2

from . import indexing
# the generated module on disk (its folder, bound and fallback) is the cache's: re-exported here
from .cache import cache_dir, digest, import_module, templates_dir, write_module  # noqa: F401
from .dtypes import DType
from .errors import CompileError
from .safe_source import check_source, comment_text
from .storage import Storage, Tensor, literal

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
        return jinja2.FileSystemBytecodeCache(str(templates_dir()))
    except OSError:  # a read-only home: templates are compiled in every process instead
        return None


class Module:
    """What every function of one generated module shares: array types, helpers, names."""

    def __init__(self) -> None:
        self.array_types: dict[tuple[str, int], str] = {}
        self.shared_types: dict[tuple[str, int], str] = {}  # (GPU kernels only: shared memory)
        self.helpers: dict[str, set[str]] = {}  # shaders module -> DSL functions imported from it
        # what each run-time check reports: code k + 1 in the `errors` buffer means checks[k]
        self.checks: list[str] = []
        self._counter = 0

    def fresh(self, prefix: str) -> str:
        """Return a name no other fresh call of this module returns: prefix and a counter, with an
        underscore after a prefix that ends in a digit ("t2" and 547 would be "t2547", which "t" and
        2547 also make: a GRU's float4 and int locals of one kernel collided that way on CUDA)."""
        self._counter += 1
        return f"{prefix}{'_' if prefix[-1:].isdigit() else ''}{self._counter}"

    def imports(self) -> list[tuple[str, list[str]]]:
        """Return (shaders module, sorted names) of every helper import, sorted by module."""
        return [(m, sorted(names)) for m, names in sorted(self.helpers.items())]

    def array_type(self, dsl: str, n: int) -> str:
        """Return the module-level name of luisa.ArrayType(n, dsl), declaring it once."""
        key = (dsl, max(int(n), 1))
        if key not in self.array_types:
            self.array_types[key] = f"Arr_{dsl}_{key[1]}"
        return self.array_types[key]


    def shared_type(self, dsl: str, n: int) -> str:
        """Return the module-level name of luisa.SharedArrayType(n, dsl), declaring it once."""
        key = (dsl, max(int(n), 1))
        if key not in self.shared_types:
            self.shared_types[key] = f"Shared_{dsl}_{key[1]}"
        return self.shared_types[key]


class KernelContext:
    """Collects the lines of one function body; operators emit through it.

    errors: the name of the int buffer run-time checks flag (None: checks are left out, as in
    the embeddable `forward`, whose signature carries no error buffer)."""

    ERRORS = "errors"
    # an inline expression is being built (schedule.Inline): no statement may be emitted, `let`
    # returns its expression instead of a variable
    pure = False
    # in a batched items stage (emission.py sets them): the DSL names of the sample and of the batch
    # size of the launch, and at_sample(s), a context manager under which every tensor the stage
    # touches is bound at sample s (an operator that gathers rows of other samples: SparseConv3d
    # over a grid bound at run time, a voxel a sample)
    sample: str | None = None
    n_samples: str | None = None
    at_sample = None

    def __init__(self, module: Module, indent: int = 1, errors: str | None = None,
                 subgraph_scope: Callable | None = None) -> None:
        self.module = module
        self.out: list[str] = []
        self.level = indent
        self.errors = errors
        # (ctx, code, io_storage) -> a context manager emitting a subgraph (emission.graph_scope, which
        # the kernels' contexts are given): how If, Loop and Scan emit their bodies without importing
        # the layer above them
        self._subgraph_scope = subgraph_scope

    def emit_subgraph(self, code, io_storage: dict | None = None):
        """Return a context manager that emits a subgraph's nodes here (code: a compiled subgraph,
        luisaml.plan.GraphCode; io_storage: its inputs' storage by name) and keeps its bindings
        active for the caller's block (a Loop copies its body's outputs after the body)."""
        if self._subgraph_scope is None:
            raise CompileError("internal error: a subgraph emitted through a context that cannot emit one")
        return self._subgraph_scope(self, code, io_storage or {})

    # ---- lines ---------------------------------------------------------------------------
    def line(self, text: str) -> None:
        if self.pure:
            raise CompileError(f"internal error: a statement inside an inline expression: {text.strip()}")
        self.out.append("    " * self.level + text)

    def line_if(self, cond: str | None, text: str) -> None:
        """Emit a line, under `if cond:` unless cond is None (a store past a tile's safe part)."""
        if cond is None:
            self.line(text)
            return
        self.line(f"if {cond}:")
        with self.indent():
            self.line(text)

    def lines(self, text: str) -> None:
        """Emit a block of lines (e.g. a rendered template), keeping its relative indentation."""
        for raw in text.splitlines():
            if raw.strip():
                self.line(raw.rstrip())

    def comment(self, text: str) -> None:
        """Emit a comment; model text in it is escaped (safe_source.comment_text)."""
        self.line("# " + comment_text(text))

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

    def flag_error(self, message: str) -> str | None:
        """Return a statement recording `message` as this launch's error (the runtime raises it
        after the launch), or None where run-time checks are off."""
        if self.errors is None:
            return None
        if message not in self.module.checks:
            self.module.checks.append(message)
        return f"{self.errors}.write(0, {self.module.checks.index(message) + 1})"

    def let(self, expr: str, prefix: str = "t") -> str:
        """Emit `v = expr` for a fresh v and return v (names and numbers are returned as they are;
        in a pure context the parenthesised expression itself)."""
        if expr.replace("_", "").isalnum():
            return expr
        if self.pure and isinstance(expr, indexing.Affine):  # (kept whole: its divisions may fold)
            return expr
        if self.pure:
            return f"({expr})"
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

    def shared_array(self, dsl: str, n: int, prefix: str = "sh") -> str:
        """Declare an array of n elements in the block's shared memory here; return its name."""
        name = self.fresh(prefix)
        self.line(f"{name} = {self.module.shared_type(dsl, n)}()")
        return name

    def use_helper(self, name: str, module: str = "dsl_lib") -> str:
        """Import a DSL function from luisaml.shaders.<module> into the module; return its name."""
        self.module.helpers.setdefault(module, set()).add(name)
        return name

    def render(self, template: str, **values) -> None:
        """Render a template from shaders/ with `values` and emit it here."""
        self.lines(template_env().get_template(template).render(ctx=self, **values))


# ---- inline expressions ------------------------------------------------------------------------


# The threads of a block of the CPU backend's stage kernels (the merged kernel and those apart,
# emission.py; the recurrent steps' spread, operators/rnn_stages.py): one block runs on one worker
# thread, so with luisa.func's default of 256 a stage of 256 work items or fewer ran on one core
# (EfficientNet-B0's last 1x1 conv, 80 items: 0.73 ms, 0.48 in blocks of 16; SqueezeNet 6.7 -> 5.6
# ms in blocks of 64); blocks of 16 cost the element stages up to 8% (DenseNet's 200k-element
# BatchNorm + Relu 1.55 -> 1.67 ms): benchmarks/NOTES.md, "Blocks of 32 threads on the CPU"
CPU_BLOCK = 32


# An inline expression longer than this is materialised instead. The schedule's budget counts
# nodes, but index arithmetic repeats the reader's index once per coordinate it unravels, so a
# chain of remaps (Concat of Concats, Transpose after Slice ...) grows geometrically in text: 20 MB
# of source for six nested Concats before this check. Typical inline expressions are under 1,000.
INLINE_CHARS = 4096

_oversized: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("oversized", default=None)


@contextlib.contextmanager
def collect_oversized() -> Iterator[set[str]]:
    """Within the block, an inline tensor whose expression (or the index it is read at) would pass
    INLINE_CHARS is recorded in the yielded set and read as 0, so the emission finishes quickly;
    the compiler schedules again with those tensors materialised (compiler.build_plan)."""
    found: set[str] = set()
    token = _oversized.set(found)
    try:
        yield found
    finally:
        _oversized.reset(token)


@dataclass
class Inline(Storage):
    """A tensor computed where it is read: its producer's element() as an expression (schedule.py:
    an inline node's output needs no buffer)."""

    op: Any  # luisaml.operator.Operator (a layer above this module)
    k: int
    module: Module

    def load(self, i: str) -> str:
        found = _oversized.get()
        if found is not None and len(i) > INLINE_CHARS // 2:
            found.add(self.op.outputs[self.k].name)
            return "0"
        ctx = KernelContext(self.module)
        ctx.pure = True
        expr = f"({self.op.element(ctx, i, self.k)})"
        if found is not None and len(expr) > INLINE_CHARS:
            found.add(self.op.outputs[self.k].name)
            return "0"
        return expr


# ---- the module file ---------------------------------------------------------------------------


def render_module(**values) -> str:
    """Return the source of a generated module (shaders/module.py.j2), checked by
    safe_source.check_source before anything writes or imports it."""
    source = template_env().get_template("module.py.j2").render(**values) + "\n"
    check_source(source)
    return source
