"""How text from a model may enter generated source, and the check every generated module passes.

luisaml writes a Python module and imports it (luisa-python compiles DSL functions from their
source file), so anything a model carries into that source would be code. Three rules keep it
data:

- identifiers come from `Identifiers`: ASCII only (so Python's NFKC normalisation of identifiers
  cannot merge two names), a fixed prefix (no keyword, no dunder), and a counter on collision
  (distinct names never merge);
- text in comments goes through `comment_text`: `ascii()`-escaped, so no character that
  `str.splitlines()` breaks on (\\r, \\x0b, \\x1c, \\x85, \\u2028, ...) can end a comment early;
- `check_source` parses every generated module before it is written and accepts only what
  luisaml emits: imports of luisa and luisaml.shaders, type declarations, `@luisa.func`
  functions whose statements are assignments, loops and branches over DSL builtins, declared
  names and 32-bit integer literals. A string or a call the whitelist does not know is an
  internal error, never code that runs.
"""
from __future__ import annotations

import ast
import re

from .errors import CompileError

_PLAIN = re.compile(r"[A-Za-z0-9_]+")
MAX_IDENT = 60


class Identifiers:
    """A collision-free map from tensor names to DSL identifiers within one generated module."""

    def __init__(self) -> None:
        self._by_name: dict[tuple[str, str], str] = {}
        self._taken: set[str] = set()

    def get(self, name: str, prefix: str) -> str:
        """Return the identifier of `name` under `prefix` (the same one every time it is asked)."""
        key = (prefix, name)
        if key in self._by_name:
            return self._by_name[key]
        stem = re.sub(r"[^A-Za-z0-9_]", "_", name)[: MAX_IDENT - len(prefix) - 8]
        base = f"{prefix}_{stem}"
        ident, k = base, 1
        while ident in self._taken:
            k += 1
            ident = f"{base}_{k}"
        self._taken.add(ident)
        self._by_name[key] = ident
        return ident


MAX_TEXT = 400  # characters of model text kept in one comment or docstring


def comment_text(text: str) -> str:
    """Return model text safe to put after '# ': printable ASCII, every other character escaped,
    cut to MAX_TEXT characters (a 100,000-character node name makes no readable comment)."""
    escaped = ascii(str(text))[1:-1]  # ascii() escapes \r, \x0b, \x85, \u2028 and all non-ASCII
    if len(escaped) > MAX_TEXT:
        import hashlib

        escaped = f"{escaped[:MAX_TEXT - 40]}...[{len(escaped)} chars, sha256 {hashlib.sha256(escaped.encode()).hexdigest()[:12]}]"
    return escaped


def docstring_text(text: str) -> str:
    """Return model text safe inside a triple-quoted docstring: escaped as in a comment, and every
    backslash and double quote escaped again, so nothing can close the string."""
    return comment_text(text).replace("\\", "\\\\").replace('"', '\\"')


def quoted(name: str) -> str:
    """Return a model name for a comment, quoted and escaped ('a\\rb' stays on one line)."""
    return "'" + comment_text(name).replace("'", "\\'") + "'"


# ---- the check ---------------------------------------------------------------------------------

_INT_MIN, _INT_MAX, _UINT_MAX = -(2**31), 2**31 - 1, 2**32 - 1
_TYPE_NAMES = {"int", "float", "bool", "uint", "half", "long", "ulong", "short", "ushort", "range"}
_LUISA_MODULE_CALLS = {"ArrayType", "SharedArrayType", "StructType", "func"}
_SAFE_ATTR = re.compile(r"[a-z][A-Za-z0-9_]*")  # .read, .write, .atomic_fetch_add, .x, .xyz


def _dsl_builtins() -> frozenset[str]:
    """Return the names luisa-python's DSL resolves as builtins or vector/matrix constructors."""
    names = set(_TYPE_NAMES)
    try:
        import luisa.builtin as b
        import luisa.mathtypes as m

        names |= set(b.builtin_func_names) | set(getattr(b, "_func_map", {}))
        names |= {"bitwise_cast", "discard"}
        names |= {n for n in dir(m) if not n.startswith("_")}
    except ImportError:  # the check still runs (stricter) where luisa is missing
        pass
    return frozenset(names)


_BUILTINS: frozenset[str] | None = None


def check_source(source: str) -> None:
    """Raise CompileError unless `source` is a module of the shape luisaml generates (see the
    module docstring); it runs before the module is written or imported."""
    global _BUILTINS
    if _BUILTINS is None:
        _BUILTINS = _dsl_builtins()
    if not source.isascii() or any(c in source for c in "\r\x0b\x0c\x1c\x1d\x1e"):
        raise _internal("the generated source holds a non-ASCII character or a line break other than \\n")
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise _internal(f"the generated source does not parse ({e.msg}, line {e.lineno})") from None
    _Checker(_BUILTINS).check_module(tree)


def _internal(message: str) -> CompileError:
    return CompileError(f"internal error, refusing to load the generated module: {message}")


class _Checker:
    """Walks a generated module and raises on anything outside the whitelist."""

    def __init__(self, builtins: frozenset[str]) -> None:
        self.builtins = builtins
        self.module_names: set[str] = set()

    def fail(self, node: ast.AST, what: str) -> None:
        raise _internal(f"line {getattr(node, 'lineno', '?')}: {what}")

    # -- module level ------------------------------------------------------------------------
    def check_module(self, tree: ast.Module) -> None:
        for k, st in enumerate(tree.body):
            self.module_names |= _defined_names(st)
        self.module_names |= {"INF", "NAN"}
        for k, st in enumerate(tree.body):
            if k == 0 and _is_docstring(st):
                continue
            if isinstance(st, ast.Import):
                if [a.name for a in st.names] != ["luisa"] or st.names[0].asname:
                    self.fail(st, "an import other than luisa")
            elif isinstance(st, ast.ImportFrom):
                mod = st.module or ""
                if st.level or not (mod in ("luisa.mathtypes", "luisa.types") or re.fullmatch(r"luisaml\.shaders\.[a-z_]+", mod)):
                    self.fail(st, f"an import from {mod!r}")
                for a in st.names:
                    if a.asname or not (a.name == "*" or _PLAIN.fullmatch(a.name)):
                        self.fail(st, "an unexpected imported name")
            elif isinstance(st, ast.Assign):
                self.check_module_assign(st)
            elif isinstance(st, ast.FunctionDef):
                self.check_function(st)
            else:
                self.fail(st, f"a module-level {type(st).__name__}")

    def check_module_assign(self, st: ast.Assign) -> None:
        if len(st.targets) != 1 or not isinstance(st.targets[0], ast.Name):
            self.fail(st, "a module-level assignment to something other than a name")
        v = st.value
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "float":
            if len(v.args) == 1 and isinstance(v.args[0], ast.Constant) and v.args[0].value in ("inf", "nan", "-inf"):
                return
        if (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and isinstance(v.func.value, ast.Name)
                and v.func.value.id == "luisa" and v.func.attr in _LUISA_MODULE_CALLS):
            for a in list(v.args) + [kw.value for kw in v.keywords]:
                self.check_expr(a)
            return
        self.fail(st, "a module-level assignment that is not a type declaration")

    def check_function(self, fn: ast.FunctionDef) -> None:
        ok_decorator = (len(fn.decorator_list) == 1 and isinstance(fn.decorator_list[0], ast.Attribute)
                        and isinstance(fn.decorator_list[0].value, ast.Name)
                        and fn.decorator_list[0].value.id == "luisa" and fn.decorator_list[0].attr == "func")
        if not ok_decorator:
            self.fail(fn, f"function '{fn.name}' is not a plain @luisa.func")
        a = fn.args
        if a.vararg or a.kwarg or a.kwonlyargs or a.defaults or a.kw_defaults or a.posonlyargs:
            self.fail(fn, f"function '{fn.name}' has a non-plain signature")
        for arg in a.args:
            if arg.annotation is not None and not (isinstance(arg.annotation, ast.Name) and arg.annotation.id in _TYPE_NAMES):
                self.fail(fn, f"parameter '{arg.arg}' has an unexpected annotation")
        body = fn.body[1:] if fn.body and _is_docstring(fn.body[0]) else fn.body
        self.check_block(body)

    # -- statements ---------------------------------------------------------------------------
    def check_block(self, body: list[ast.stmt]) -> None:
        for st in body:
            self.check_stmt(st)

    def check_stmt(self, st: ast.stmt) -> None:
        if isinstance(st, ast.Assign):
            for t in st.targets:
                self.check_target(t)
            self.check_expr(st.value)
        elif isinstance(st, ast.AugAssign):
            self.check_target(st.target)
            self.check_expr(st.value)
        elif isinstance(st, ast.AnnAssign):
            self.check_target(st.target)
            if st.value is not None:
                self.check_expr(st.value)
            self.check_expr(st.annotation)
        elif isinstance(st, ast.Expr):
            if not isinstance(st.value, ast.Call):
                self.fail(st, "an expression statement that is not a call")
            self.check_expr(st.value)
        elif isinstance(st, ast.For):
            self.check_target(st.target)
            it = st.iter
            if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"):
                self.fail(st, "a for loop over something other than range()")
            self.check_expr(it)
            self.check_block(st.body)
            self.check_block(st.orelse)
        elif isinstance(st, (ast.While, ast.If)):
            self.check_expr(st.test)
            self.check_block(st.body)
            self.check_block(st.orelse)
        elif isinstance(st, ast.Return):
            if st.value is not None:
                self.check_expr(st.value)
        elif not isinstance(st, (ast.Pass, ast.Break, ast.Continue)):
            self.fail(st, f"a {type(st).__name__} statement")

    def check_target(self, t: ast.expr) -> None:
        if isinstance(t, ast.Name):
            return
        if isinstance(t, (ast.Subscript, ast.Attribute)):
            self.check_expr(t)
            return
        if isinstance(t, ast.Tuple):
            for e in t.elts:
                self.check_target(e)
            return
        self.fail(t, f"an assignment to a {type(t).__name__}")

    # -- expressions --------------------------------------------------------------------------
    def check_expr(self, e: ast.expr, in_uint: bool = False) -> None:
        if isinstance(e, ast.Constant):
            v = e.value
            if isinstance(v, bool) or v is None or isinstance(v, float):
                return
            if isinstance(v, int):
                if not (_INT_MIN <= v <= (_UINT_MAX if in_uint else _INT_MAX)):
                    self.fail(e, f"integer literal {v} beyond the kernel's 32-bit integers")
                return
            self.fail(e, f"a {type(v).__name__} constant")
        elif isinstance(e, ast.Name):
            if e.id.startswith("__"):
                self.fail(e, f"the name {e.id!r}")
        elif isinstance(e, ast.Attribute):
            if not _SAFE_ATTR.fullmatch(e.attr):
                self.fail(e, f"the attribute {e.attr!r}")
            self.check_expr(e.value)
        elif isinstance(e, ast.Call):
            self.check_call(e)
        elif isinstance(e, ast.UnaryOp):
            # -2147483648 is written as -(2147483648) by some emitters: allow it in the negation
            if isinstance(e.op, ast.USub) and isinstance(e.operand, ast.Constant) and isinstance(e.operand.value, int):
                if not (0 <= e.operand.value <= 2**31):
                    self.fail(e, f"integer literal -{e.operand.value} beyond the kernel's 32-bit integers")
                return
            self.check_expr(e.operand, in_uint)
        elif isinstance(e, ast.BinOp):
            self.check_expr(e.left, in_uint)
            self.check_expr(e.right, in_uint)
        elif isinstance(e, ast.BoolOp):
            for v in e.values:
                self.check_expr(v)
        elif isinstance(e, ast.Compare):
            self.check_expr(e.left)
            for c in e.comparators:
                self.check_expr(c)
        elif isinstance(e, ast.IfExp):
            self.check_expr(e.test)
            self.check_expr(e.body, in_uint)
            self.check_expr(e.orelse, in_uint)
        elif isinstance(e, ast.Subscript):
            self.check_expr(e.value)
            self.check_expr(e.slice)
        elif isinstance(e, ast.Tuple):
            for x in e.elts:
                self.check_expr(x)
        else:
            self.fail(e, f"a {type(e).__name__} expression")

    def check_call(self, c: ast.Call) -> None:
        f = c.func
        if isinstance(f, ast.Name):
            if f.id not in self.builtins and f.id not in self.module_names:
                self.fail(c, f"a call to {f.id!r}, which is neither a DSL builtin nor declared in the module")
        elif isinstance(f, ast.Attribute):
            self.check_expr(f)
        else:
            self.fail(c, "a call of a computed function")
        in_uint = isinstance(f, ast.Name) and f.id == "uint"
        for a in c.args:
            self.check_expr(a, in_uint)
        for kw in c.keywords:
            if kw.arg is None:
                self.fail(c, "a call with **keywords")
            self.check_expr(kw.value)


def _is_docstring(st: ast.stmt) -> bool:
    return isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant) and isinstance(st.value.value, str)


def _defined_names(st: ast.stmt) -> set[str]:
    if isinstance(st, ast.FunctionDef):
        return {st.name}
    if isinstance(st, ast.Assign):
        return {t.id for t in st.targets if isinstance(t, ast.Name)}
    if isinstance(st, ast.ImportFrom):
        return {a.name for a in st.names if a.name != "*"}
    if isinstance(st, ast.Import):
        return {a.name for a in st.names}
    return set()
