"""The tuning cache: the schedule a search chose for a kernel, one small JSON file per key under
the cache root's tuning/ folder (beside generated/, luisaml/cache.py), bounded like generated/
(least recently used first out).

A key is JSON data naming what the measurement depends on: the operator's form, its shapes and
dtypes, its attributes, the device's name and luisaml's version (luisaml/tune.py builds it); its
file is named by the key's hash and holds the key itself, so a collision or a file moved under
another name reads as a miss. An entry is data only: read with json, every field checked for
type and range, and anything else (unreadable, truncated, too large, another key, a field of the
wrong type) is ignored with a warning: the compile then measures again and writes a sound entry.
The operator checks the choice once more (it must be one of its own candidates: luisaml/tune.py)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from . import cache
from .log import logger

FORMAT = 1
# an entry is a few hundred bytes: a larger file is not one of ours
MAX_ENTRY_BYTES = 64 * 1024
# entries kept per cache root (a model has tens of tunable kernels): beyond it, the least recently used go
MAX_ENTRIES = 4096
# a knob's value: a small int, a bool or a short word (a schedule's "form")
MAX_KNOB = 1 << 16


def folder(path: str | os.PathLike | None = None) -> Path:
    """Return the tuning cache's folder (made when missing)."""
    d = cache.root(path) / "tuning"
    d.mkdir(exist_ok=True)
    return d


def key_digest(key: dict[str, Any]) -> str:
    """Return the hash that names a key's file."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


def valid_choice(choice: Any) -> bool:
    """Whether a schedule is plain data within bounds: {name: small int | bool | short word}."""
    if not isinstance(choice, dict) or not 0 < len(choice) <= 16:
        return False
    for k, v in choice.items():
        if not isinstance(k, str) or len(k) > 16:
            return False
        if isinstance(v, bool):
            continue
        if isinstance(v, int):
            if not 0 <= v <= MAX_KNOB:
                return False
        elif not (isinstance(v, str) and len(v) <= 16 and v.isalnum()):
            return False
    return True


def _times(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= 64 and all(
        isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t < 1e7 for t in v)


def load(key: dict[str, Any], path: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """Return the entry stored for a key ({"choice", "ms", "rule_ms"}), or None when there is none
    or it is not sound (said with a warning)."""
    f = folder(path) / f"{key_digest(key)}.json"
    try:
        if f.stat().st_size > MAX_ENTRY_BYTES:
            return _ignored(f, f"larger than {MAX_ENTRY_BYTES} bytes")
        data = json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        return _ignored(f, f"unreadable ({type(e).__name__})")
    if not isinstance(data, dict) or set(data) != {"format", "key", "choice", "ms", "rule_ms"}:
        return _ignored(f, "not a tuning entry")
    if data["format"] != FORMAT or data["key"] != key:
        return _ignored(f, "another format or key")
    if not valid_choice(data["choice"]) or not _times(data["ms"]) or not _times([data["rule_ms"]]):
        return _ignored(f, "a field of the wrong type or range")
    with contextlib.suppress(OSError):
        os.utime(f)  # (used: the bound removes the least recently used first)
    return {"choice": data["choice"], "ms": data["ms"], "rule_ms": float(data["rule_ms"])}


def _ignored(f: Path, why: str) -> None:
    logger.warning("tuning cache entry '%s' ignored: %s (it is measured again)", f, why)
    return None


def store(key: dict[str, Any], choice: dict[str, Any], ms: list[float], rule_ms: float,
          path: str | os.PathLike | None = None) -> Path:
    """Write a key's entry atomically (a reader sees the old file or the new one) and keep the
    folder within MAX_ENTRIES; return its path."""
    if not valid_choice(choice):
        raise ValueError(f"not a schedule: {choice!r:.200}")
    d = folder(path)
    text = json.dumps({"format": FORMAT, "key": key, "choice": choice, "ms": [round(t, 6) for t in ms],
                       "rule_ms": round(rule_ms, 6)}, sort_keys=True)
    target = d / f"{key_digest(key)}.json"
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".entry-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _prune(d)
    return target


def _prune(d: Path) -> None:
    try:
        files = [(e.stat().st_mtime, e.path) for e in os.scandir(d) if e.name.endswith(".json")]
    except OSError:
        return
    if len(files) <= MAX_ENTRIES:
        return
    for _, p in sorted(files)[: len(files) - MAX_ENTRIES]:
        with contextlib.suppress(OSError):
            os.unlink(p)


__all__ = ["folder", "key_digest", "load", "store", "valid_choice", "FORMAT", "MAX_ENTRIES"]
