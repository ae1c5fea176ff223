"""Caches: a damaged or unusable luisaml cache (LUISAML_CACHE: generated modules, kernel locks,
compiled templates) and a damaged LuisaCompute kernel cache.

The luisaml cache cases point LUISAML_CACHE at a folder of the case's own (in child processes:
luisaml reads the variable once, at import). Faults: the folder is a
file, read-only (a read-only bind mount in a private mount namespace: the suite runs as root,
which permission bits do not stop), full (a 16 KiB tmpfs), a generated module with bad UTF-8,
truncated, emptied, replaced by a directory or by code that would create the marker, template
bytecode that is garbage. A compile must then give the right outputs or a luisaml error naming
the cache path; a tampered module must never be imported.

The kernel cache lives next to the Python executable (<dir of realpath(/proc/self/exe)>/.cache,
LuisaCompute's choice), shared by every process on the machine. These cases never touch it: they
copy the Python executable into the case folder (PYTHONHOME points the copy at the real
installation), so the copy's kernel cache is private; a first child process fills it, the case
damages it (truncated, empty, garbage .bc files, a wrong .hash, a directory in place of a file),
and a second child compiles again.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
from onnx import helper

from .. import child
from ..harness import (
    FAIL_ERROR,
    FAIL_HARNESS,
    Case,
    Fail,
    compare_outputs,
    names_offender,
    recipe,
    short,
)
from ..models import F, make_model, save, vi

X = np.random.default_rng(0).uniform(-2, 2, (3, 4)).astype(np.float32)


def cache_model(folder: Path, nonce: str):
    """Return (model path, feeds, reference) of a small model whose generated module and kernel are
    the case's own (the nonce is in a constant, so neither is shared with another case)."""
    bias = np.array([int.from_bytes(nonce.encode(), "little") % 9973 / 997.0, 1.5, -2.0, 0.25], np.float32)
    nodes = [helper.make_node("Add", ["x", "bias"], ["h"], name="add"), helper.make_node("Tanh", ["h"], ["y"], name="tanh")]
    m = make_model(nodes, [vi("x", F, ["N", 4])], [vi("y", F, ["N", 4])], {"bias": bias}, name=f"cache_{nonce}")
    path = save(m, folder / "model.onnx")
    return path, {"x": X}, {"y": np.tanh(X + bias).astype(np.float32)}


def judge_child(res: child.ChildResult, offender, reference, what: str) -> None:
    """Judge a child process's report like an attempt."""
    r = res.report
    if r.get("ok"):
        diff = compare_outputs(res.outputs, reference, 1e-3, 1e-4)
        if diff:
            from ..harness import FAIL_WRONG

            raise Fail(FAIL_WRONG, f"{what}: {diff}")
        return
    if not r.get("luisaml"):
        raise Fail(FAIL_ERROR, f"{what}: {r.get('type')}: {short(r.get('message', ''))} | "
                               f"{short(r.get('traceback', '').strip().splitlines()[-3] if r.get('traceback') else '')}")
    if not names_offender(r.get("message", ""), offender):
        raise Fail(FAIL_ERROR, f"{what}: the message does not name {short(ascii(offender), 80)}: {short(r['message'])}")


# ---- the luisaml cache, read by fresh processes ---------------------------------------------------
# luisaml reads LUISAML_CACHE once, when it is imported: every case here runs its compiles in child
# processes with the variable set, so each sees the cache as a user's next process would.

def _damage(cache: Path, kind: str, marker: str) -> list[Path]:
    """Damage a filled cache one way; return the files damaged."""
    modules = sorted((cache / "generated").glob("net_*.py"))
    templates = sorted((cache / "templates").glob("*"))
    targets = templates if kind.startswith("templates_") else modules
    if kind.startswith(("module_", "templates_")) and not targets:
        raise Fail(FAIL_HARNESS, f"nothing to damage for {kind} in {cache} (has the cache layout changed?)")
    for p in targets:
        data = p.read_bytes()
        if kind == "module_truncated":
            p.write_bytes(data[: len(data) // 2])
        elif kind == "module_empty":
            p.write_bytes(b"")
        elif kind == "module_tampered":  # valid Python that a luisaml trusting its cache would run
            p.write_text(f"__import__('pathlib').Path({marker!r}).touch()\n" + data.decode())
        elif kind == "module_bad_utf8":
            p.write_bytes(data[:40] + b"\xff\xfe\x80 not utf-8\n" + data[40:])
        elif kind == "module_directory":
            p.unlink()
            p.mkdir()
        elif kind == "templates_garbage":
            p.write_bytes(os.urandom(200))
        elif kind == "templates_truncated":
            p.write_bytes(data[: max(1, len(data) // 3)])
    if kind == "locks_is_file":
        shutil.rmtree(cache / "locks", ignore_errors=True)
        (cache / "locks").write_text("not a folder")
        targets = [cache / "locks"]
    return targets


@recipe("cache.luisaml")
def luisaml_cache(ctx, kind: str) -> None:
    cache = ctx.path("luisaml cache")
    model, feeds, ref = cache_model(ctx.dir, f"{kind}-{ctx.case.id}")
    offender = (str(cache), cache.name, "LUISAML_CACHE")
    if kind in ("is_file", "parent_is_file", "odd_path"):
        if kind == "odd_path":
            cache = ctx.path("cache \r\n\u2028 é")
            offender = (str(cache),)
        else:
            cache.write_text("not a folder")
            cache = cache / "sub" if kind == "parent_is_file" else cache
        env = {"LUISAML_CACHE": str(cache), "LUISAML_BACKEND": "cpu"}
        judge_child(child.run(ctx.path("run"), "only", model, feeds, env=env), offender, ref, kind)
        return
    env = {"LUISAML_CACHE": str(cache), "LUISAML_BACKEND": "cpu"}
    judge_child(child.run(ctx.path("run1"), "first", model, feeds, env=env), (), ref, "first compile")
    damaged = _damage(cache, kind, ctx.marker)
    second = child.run(ctx.path("run2"), "second", model, feeds, env=env)
    judge_child(second, (*offender, *(p.name for p in damaged)), ref, "second compile")


# ---- caches on file systems that refuse writes -----------------------------------------------------

def _unshare_ok() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "true"], capture_output=True).returncode == 0


@recipe("cache.mounted")
def mounted(ctx, kind: str) -> None:
    """The cache on a read-only mount or a full tmpfs, in a private mount namespace."""
    if not _unshare_ok():
        raise Fail(FAIL_HARNESS, "unshare -rm is not permitted here: cannot make a read-only cache as root")
    cache = ctx.path("cache")
    cache.mkdir()
    model, feeds, ref = cache_model(ctx.dir, f"{kind}-{ctx.case.id}")
    env = {"LUISAML_CACHE": str(cache), "LUISAML_BACKEND": "cpu"}
    if kind == "readonly_warm":  # filled first, then read-only
        judge_child(child.run(ctx.path("run1"), "fill", model, feeds, env=env), (), ref, "filling the cache")
    mount = {"readonly_cold": f"mount --bind -o ro '{cache}' '{cache}' && mount -o remount,bind,ro '{cache}'",
             "readonly_warm": f"mount --bind '{cache}' '{cache}' && mount -o remount,bind,ro '{cache}'",
             "full": f"mount -t tmpfs -o size=16k tmpfs '{cache}'"}[kind]
    wrap = ["unshare", "-rm", "sh", "-c", f'{mount} && exec "$@"', "sh"]
    res = child.run(ctx.path("run2"), "mounted", model, feeds, env=env, wrap=wrap)
    judge_child(res, (str(cache), "cache", "LUISAML_CACHE", "read-only", "space"), ref, kind)


# ---- the LuisaCompute kernel cache, in a copy -------------------------------------------------------

@recipe("cache.kernel")
def kernel_cache(ctx, kind: str) -> None:
    python, env = child.python_copy(ctx.dir)
    kcache = Path(python).parent / ".cache"
    env.update({"LUISAML_CACHE": str(ctx.path("luisaml-cache")), "LUISAML_BACKEND": "cpu"})
    model, feeds, ref = cache_model(ctx.dir, f"{kind}-{ctx.case.id}")
    if kind == "cache_dir_is_file":
        kcache.write_text("not a folder")
    else:
        first = child.run(ctx.path("run1"), "first", model, feeds, python=python, env=env)
        judge_child(first, (), ref, "first compile (fills the copy's kernel cache)")
        bcs = sorted(kcache.glob("kernel_*.bc"))
        if not bcs:
            raise Fail(FAIL_HARNESS, f"no kernel_*.bc in {kcache}: LuisaCompute keeps its cache elsewhere now")
        for bc in bcs:
            data = bc.read_bytes()
            if kind == "bc_truncated":
                bc.write_bytes(data[: len(data) // 2])
            elif kind == "bc_empty":
                bc.write_bytes(b"")
            elif kind == "bc_garbage":
                bc.write_bytes(os.urandom(len(data)))
            elif kind == "bc_header_only":
                bc.write_bytes(data[:32])
            elif kind == "bc_directory":
                bc.unlink()
                bc.mkdir()
            elif kind == "hash_mismatch":
                h = bc.with_suffix(".hash")
                if h.exists():
                    h.write_bytes(b"0" * len(h.read_bytes()))
            else:
                raise Fail(FAIL_HARNESS, f"unknown kind {kind!r}")
    second = child.run(ctx.path("run2"), "second", model, feeds, python=python, env=env)
    judge_child(second, (str(kcache), ".cache", "kernel", "cache"), ref, f"compile with a {kind} kernel cache")


LUISAML_KINDS = ("is_file", "parent_is_file", "odd_path", "module_bad_utf8", "module_directory", "locks_is_file",
                 "module_truncated", "module_empty", "module_tampered", "templates_garbage", "templates_truncated")
MOUNT_KINDS = ("readonly_cold", "readonly_warm", "full")
KERNEL_KINDS = ("bc_truncated", "bc_empty", "bc_garbage", "bc_header_only", "bc_directory", "hash_mismatch",
                "cache_dir_is_file")


def cases() -> list[Case]:
    out = [Case(f"cache/luisaml/{k}", "cache", "cache.luisaml", dict(kind=k), timeout=240,
                ci=k in ("module_bad_utf8", "module_tampered")) for k in LUISAML_KINDS]
    out += [Case(f"cache/mounted/{k}", "cache", "cache.mounted", dict(kind=k), timeout=240, ci=k == "readonly_cold")
            for k in MOUNT_KINDS]
    out += [Case(f"cache/kernel/{k}", "cache", "cache.kernel", dict(kind=k), timeout=300,
                 ci=k in ("bc_truncated", "bc_empty")) for k in KERNEL_KINDS]
    return out
