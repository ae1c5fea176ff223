"""The operator registry: `@register(op_type, domain=..., since=...)` and opset resolution."""
from __future__ import annotations

import bisect
from typing import Callable, TypeVar

T = TypeVar("T", bound=type)

# (domain, op_type) -> sorted list of (since, operator class)
_REGISTRY: dict[tuple[str, str], list[tuple[int, type]]] = {}


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


# operator families imported on first use of their domain (importing every family costs about a
# tenth of a second, which a cached compile of a plain MLP should not pay)
_LAZY_DOMAINS = {"fvdb": "luisaml.operators.fvdb", "luisaml": "luisaml.operators.detection"}


def load_domains(domains) -> None:
    """Import the operator families of these domains that load lazily (fVDB's)."""
    import importlib

    for d in domains:
        mod = _LAZY_DOMAINS.get(_norm_domain(d))
        if mod:
            importlib.import_module(mod)


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
    """Return every registered (domain, op_type) with its `since` versions."""
    _load_builtin()
    load_domains(_LAZY_DOMAINS)
    return {k: [s for s, _ in v] for k, v in sorted(_REGISTRY.items())}


def _load_builtin() -> None:
    """Import the shipped operator modules so that they register themselves (the lazy domains'
    on first use)."""
    import luisaml.operators  # noqa: F401
