"""The operator registry: `@register(op_type, domain=..., since=...)`, opset resolution, and the
binding of a model's op kinds to their classes (`Binding`).

The registry imports no operator: an operator family registers itself when its module is imported.
The shipped families are `luisaml.operators`, which the compiler imports; that package names here the
families it loads only on their domain's first use (`load_on_first_use`: fVDB's, whose import costs a
tenth of a second that a cached compile of a plain MLP should not pay)."""
from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

T = TypeVar("T", bound=type)

# (domain, op_type) -> sorted list of (since, operator class)
_REGISTRY: dict[tuple[str, str], list[tuple[int, type]]] = {}
# domain -> the function that imports (registers) its operators, called once on the domain's first use
_ON_FIRST_USE: dict[str, Callable[[], object]] = {}


def _norm_domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


def register(op_type: str | list[str], domain: str = "", since: int = 1) -> Callable[[T], T]:
    """Return a class decorator that registers an Operator for op_type(s) from opset `since` on."""
    names = [op_type] if isinstance(op_type, str) else list(op_type)

    def deco(cls: T) -> T:
        for name in names:
            entries = _REGISTRY.setdefault((_norm_domain(domain), name), [])
            entries[:] = [e for e in entries if e[0] != since]  # re-registering replaces
            bisect.insort(entries, (since, cls), key=lambda e: e[0])
        return cls

    return deco


def load_on_first_use(domain: str, load: Callable[[], object]) -> None:
    """Have load() register the operators of `domain` when a lookup first names it."""
    _ON_FIRST_USE[_norm_domain(domain)] = load


def load_domains(domains: Iterable[str]) -> None:
    """Register the operators of these domains that load on first use (their onnx schemas too)."""
    for d in domains:
        load = _ON_FIRST_USE.pop(_norm_domain(d), None)
        if load is not None:
            load()


def resolve(op_type: str, domain: str, opset: int) -> type | None:
    """Return the operator class with the highest `since` not above the model's opset, or None."""
    load_domains([domain])
    entries = _REGISTRY.get((_norm_domain(domain), op_type), [])
    best = None
    for since, cls in entries:
        if since <= opset or opset == 0:
            best = cls
    return best


def versions(op_type: str, domain: str = "") -> list[int]:
    """Return the `since` versions registered for an op type."""
    load_domains([domain])
    return [s for s, _ in _REGISTRY.get((_norm_domain(domain), op_type), [])]


def registered() -> dict[tuple[str, str], list[int]]:
    """Return every registered (domain, op_type) with its `since` versions (the families that load
    on first use loaded)."""
    load_domains(list(_ON_FIRST_USE))
    return {k: [s for s, _ in v] for k, v in sorted(_REGISTRY.items())}


class Binding:
    """The operator class of each op kind of one model, at the model's opsets: `binding(op_type,
    domain)` -> the class, or None when none is registered. Each kind is resolved once, on its first
    lookup, so that every pass, lowering and the host steps read the same class."""

    def __init__(self, opsets: Mapping[str, int]) -> None:
        self.opsets = {_norm_domain(d): int(v) for d, v in opsets.items()}
        self._classes: dict[tuple[str, str], type | None] = {}
        load_domains(self.opsets)  # (their onnx schemas too, which shape inference reads)

    def __call__(self, op_type: str, domain: str) -> type | None:
        key = (_norm_domain(domain), op_type)
        if key not in self._classes:
            self._classes[key] = resolve(op_type, key[0], self.opsets.get(key[0], 0))
        return self._classes[key]
