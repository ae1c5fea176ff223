"""The .lml artifact: one file holding, as data only, what a compiled network is generated from
(the prepared model, its weights, the options compile resolved), the versions it was built with
and a content hash; how `net.save` / `luisaml.save` write it, how `luisaml.load` checks it and
generates the network again without onnx or torch, and how `luisaml inspect` reads it.

The format (README.md, "The .lml artifact"), version 2, is a zip file of exactly these members:

- `manifest.json` (first): `format` "luisaml-artifact", `format_version` (FORMAT_VERSION),
  `built_with` (luisaml, luisa-python, Python, numpy versions, and a hash of each shader library
  the module imports), `backend`, `model`, `created`, `members` ({name: {sha256, bytes}}),
  `source_sha256` (the sha256 of the module compile generated), and `content_hash`: the sha256 of
  the manifest written without that key (canonical JSON), which covers every member;
- `model.json`: the prepared model and build_plan's options as strict data (luisaml/artifact_model.py);
- `weights.bin`: every array of model.json once, end to end (stored, not compressed);
- `report.json` (optional): the inspect report (luisaml/report.py, schema 1), shown by `inspect` only.

Trust model: nothing from the file is ever executed, imported or eval'ed. `load` checks every size
before it reads (a regular file, members and their total bounded, JSON depth bounded), rebuilds
the Prepared from model.json with a strict schema (types, ranges, references, op types that
resolve in this process's registry), calls the same `compiler.build_plan` that compile calls, and
refuses the file unless the regenerated module hashes to `source_sha256`. The module it then imports
is luisaml's own emission of checked data, written to the cache as compile writes it: loading a .lml
is as safe as compiling an untrusted ONNX model. The hashes find damage, not malice (anyone can
recompute them); the regeneration is what makes a crafted file harmless.

Compiled kernel binaries are not in the file: luisa-python 0.3.7 can save a shader
(`DeviceInterface.save_shader`) but has no call to load one, so every process rebuilds its
kernels from the module's source (its AST walk, then LuisaCompute's compile, which on the CPU
backend is a JIT of LLVM bitcode it caches beside the Python executable under a hash of the
generated C++ that Python cannot compute); benchmarks/NOTES.md has the measurements."""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import stat
import sys
import time
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import cache, device
from .errors import ArtifactError, IncompatibleArtifact, LuisamlError, UsageError
from .limits import Limits
from .log import logger, phase
from .network import CompiledNetwork
from .per_batch import PerBatchNetwork

if TYPE_CHECKING:
    from .plan import Plan

FORMAT = "luisaml-artifact"
FORMAT_VERSION = 2
SUFFIX = ".lml"
MANIFEST, MODEL, WEIGHTS, REPORT = "manifest.json", "model.json", "weights.bin", "report.json"
# what load() may read, checked before it reads anything: each member, their total, JSON nesting
MAX_MANIFEST_BYTES = 1 << 20
MAX_MODEL_BYTES = 256 << 20
MAX_REPORT_BYTES = 64 << 20
MAX_MANIFEST_DEPTH = 8
MAX_MODEL_DEPTH = 200  # a subgraph nests 4 levels: 50 nested If/Loop bodies
MAX_REPORT_DEPTH = 32
BACKENDS = ("cpu", "cuda")
_SHADER_IMPORT = re.compile(r"^from luisaml\.shaders\.(\w+) import", re.MULTILINE)
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _member_limits() -> dict[str, int]:
    """Each member's largest size (the weights: Limits.weight_bytes, what compile allows)."""
    return {MANIFEST: MAX_MANIFEST_BYTES, MODEL: MAX_MODEL_BYTES, WEIGHTS: Limits().weight_bytes,
            REPORT: MAX_REPORT_BYTES}


def max_total_bytes() -> int:
    """The largest total of an artifact's members (what load may read at most)."""
    return sum(_member_limits().values())


# ---- versions -------------------------------------------------------------------------------
def _dist_version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _luisaml_version() -> str:
    from .version import __version__

    return __version__


def _shader_hashes(source: str) -> dict[str, str]:
    """Return {shader library: sha256 of its file} for each luisaml.shaders module the source imports:
    the module calls their functions, so a changed library can change its outputs."""
    import importlib.util

    out = {}
    for name in sorted(set(_SHADER_IMPORT.findall(source))):
        spec = importlib.util.find_spec(f"luisaml.shaders.{name}")
        if spec is not None and spec.origin:
            out[name] = hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()
    return out


def built_with(source: str) -> dict[str, Any]:
    """Return the versions an artifact records: luisaml, luisa-python, Python, numpy, shader libraries."""
    return {"luisaml": _luisaml_version(), "luisa_python": _dist_version("luisa-python"),
            "python": sys.version.split()[0], "numpy": np.__version__, "shaders": _shader_hashes(source)}


# ---- regenerating ---------------------------------------------------------------------------
def _source_hash(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


def _check_savable(plan, fail) -> None:
    """Call fail(why) for a plan whose run needs more than kernels and static data."""
    if getattr(plan, "host_steps", None) is not None:
        fail(f"its grid ops run as steps before the kernels ({plan.host_steps.steps[0].node.describe()} builds a grid "
             "from one bound at run time, driven from Python): an artifact holds kernels and static data only")
    if getattr(plan, "readbacks", None):
        fail(f"it has outputs sized at run time ({plan.readbacks[0].node}: count, prefix sum, host read-back, fill): "
             "the artifact format stores static shapes only")
    if plan.derived:
        fail("it has host-derived inputs (" + ", ".join(d.ident for d in plan.derived) + "): an operator computes "
             "them on the host in Python (fVDB grid metadata), which an artifact cannot hold")


def regenerate(doc, weights: bytes, where: str) -> Plan:
    """Return the Plan that model.json (`doc`) and weights.bin describe, generated by the same
    build_plan compile calls; raise ArtifactError for data that does not check or does not build.
    Needs no device."""
    from . import artifact_model, compiler

    prep, name, options = artifact_model.decode(doc, weights, where)
    options = compiler.BuildOptions(**options)
    try:
        plan = compiler.build_plan(prep, name, options)
    except ArtifactError:
        raise
    except LuisamlError as e:  # (the same checks as compile's: a crafted graph fails them as a model would)
        raise ArtifactError(f"'{where}': its model does not compile: {e}") from None
    except (RecursionError, MemoryError) as e:
        raise ArtifactError(f"'{where}': its model cannot be built ({type(e).__name__})") from None
    except Exception as e:  # data that passed the schema but that no model prepared by luisaml holds
        raise ArtifactError(f"'{where}': its model is inconsistent and cannot be built "
                            f"({type(e).__name__}: {str(e)[:200]})") from None
    _check_savable(plan, lambda why: _raise(ArtifactError(f"'{where}': cannot run it here: {why}")))
    plan.built_from = (prep, name, options)  # (saving a loaded network stores the same data)
    return plan


def _raise(e: Exception):
    raise e


# ---- writing --------------------------------------------------------------------------------
def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def content_hash(manifest: dict) -> str:
    """Return the sha256 of a manifest without its `content_hash` key (canonical JSON)."""
    return hashlib.sha256(_canonical({k: v for k, v in manifest.items() if k != "content_hash"})).hexdigest()


def model_member(doc: dict) -> bytes:
    """Return the bytes of model.json for a document (ASCII JSON, no NaN: what load parses)."""
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def save(net: CompiledNetwork, path: str | os.PathLike, *, model_name: str | None = None) -> Path:
    """Write the network as one .lml file at `path` (atomically) and return the path; raise
    UsageError for a network an artifact cannot hold (one compiled per batch size, one with
    host-derived inputs or grid steps) or whose data does not generate its module again."""
    from . import artifact_model

    if isinstance(net, PerBatchNetwork):
        raise UsageError(
            f"cannot save a network that compiles per batch size ({net.why}); fix the batch size with "
            "input_shapes (--input-shapes NAME:DIMxDIM...) and batch_axis=None (--batch-axis none) to build one "
            "network")
    if not isinstance(net, CompiledNetwork):
        raise UsageError(f"luisaml.save takes a CompiledNetwork, not {type(net).__name__}")
    plan = net.plan
    stored = net.artifact  # a loaded network saves what it was loaded from
    name = model_name or (stored.model if stored is not None else None) or (plan.model.graph.name or "model")
    with phase("artifact save", path=os.fspath(path)):
        _check_savable(plan, lambda why: _raise(UsageError(f"cannot save this network: {why}")))
        built = getattr(plan, "built_from", None)
        if built is None:
            raise UsageError("cannot save this network: it was not built by luisaml.compile or luisaml.load "
                             "(its prepared model is unknown)")
        prep, built_name, options = built
        doc, weights = artifact_model.encode(prep, built_name, options.as_dict())
        model_raw = model_member(doc)
        # the check load makes, made now: the data generates this very module
        again = regenerate(json.loads(model_raw), weights, os.fspath(path))
        if again.source != plan.source:
            raise UsageError("cannot save this network: its prepared model, written as data, does not generate the "
                             "same module again (a non-deterministic emission; please report it)")
        members: dict[str, bytes] = {MODEL: model_raw, WEIGHTS: weights}
        report_data = stored.report if stored is not None else _report(plan, name)
        if report_data is not None:
            members[REPORT] = json.dumps(report_data, indent=1).encode()
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "built_with": stored.built_with if stored is not None else built_with(plan.source),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "backend": net.backend,
            "model": name,
            "members": {k: {"sha256": hashlib.sha256(v).hexdigest(), "bytes": len(v)} for k, v in members.items()},
            "source_sha256": _source_hash(plan.source),
        }
        manifest["content_hash"] = content_hash(manifest)
        out = Path(path)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        try:
            with zipfile.ZipFile(tmp, "w") as z:
                z.writestr(MANIFEST, json.dumps(manifest, indent=1), zipfile.ZIP_DEFLATED)
                for k, v in members.items():
                    z.writestr(k, v, zipfile.ZIP_STORED if k == WEIGHTS else zipfile.ZIP_DEFLATED)
            os.replace(tmp, out)
        except IsADirectoryError:
            tmp.unlink(missing_ok=True)
            raise UsageError(f"cannot write the artifact: '{out}' is a directory") from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return out


def _report(plan: Plan, name: str) -> dict | None:
    """The inspect report of the plan; None (said in the log) when it cannot be made: the
    artifact still runs, `inspect` then shows the manifest only."""
    from . import report

    try:
        return report.from_plan(plan, model_name=name)
    except Exception as e:  # a report is a convenience: never the reason a build fails
        logger.warning("the artifact holds no inspect report: %s: %s", type(e).__name__, e)
        return None


# ---- reading --------------------------------------------------------------------------------
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


def parse_json(raw: bytes, max_depth: int, what: str, where: str):
    """Return the JSON value of `raw` (UTF-8) with its nesting checked first (no RecursionError from a
    crafted document); raise ArtifactError naming the member for one that is not JSON, nests deeper
    than max_depth, or holds NaN or Infinity."""
    shell = np.frombuffer(_JSON_STRING.sub(b'""', raw), dtype=np.uint8)  # (brackets inside strings do not nest)
    step = (np.isin(shell, (ord("["), ord("{"))).astype(np.int64) - np.isin(shell, (ord("]"), ord("}"))))
    depth = int(np.cumsum(step).max()) if step.size else 0
    if depth > max_depth:
        raise ArtifactError(f"'{where}': {what} nests {depth} levels deep (at most {max_depth})")

    def no_constant(c):
        raise ValueError(f"{c} is not JSON")

    try:
        return json.loads(raw.decode("utf-8"), parse_constant=no_constant)
    except (ValueError, RecursionError) as e:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise ArtifactError(f"'{where}' is damaged: {what} is not JSON ({str(e)[:200]})") from None


@dataclass
class Artifact:
    """A .lml file read and checked (sizes, hashes, format version): its manifest and members."""

    path: str
    manifest: dict
    members: dict[str, bytes]
    seconds: dict[str, float] = field(default_factory=dict)  # read, hash, rebuild: where load's time went
    _plan: Any = None

    @property
    def backend(self) -> str:
        """Return the backend it was built for ("cpu" or "cuda"): the only one it runs on."""
        return self.manifest["backend"]

    @property
    def model(self) -> str:
        """Return the name of the model it was built from."""
        return self.manifest["model"]

    @property
    def built_with(self) -> dict:
        """Return the versions it was built with (luisaml, luisa_python, python, numpy, shaders)."""
        return self.manifest["built_with"]

    @property
    def content_hash(self) -> str:
        """Return the sha256 of its manifest (which covers every member through its hash)."""
        return self.manifest["content_hash"]

    @property
    def report(self) -> dict | None:
        """Return the inspect report made when it was built (luisaml/report.py, schema 1), or None;
        data only, checked to render (a report that does not is an ArtifactError)."""
        raw = self.members.get(REPORT)
        if raw is None:
            return None
        rep = parse_json(raw, MAX_REPORT_DEPTH, REPORT, self.path)
        if not isinstance(rep, dict) or rep.get("schema") != 1:
            raise ArtifactError(f"'{self.path}': {REPORT} is not an inspect report of schema 1")
        from . import report

        try:
            report.text(rep)
            report.html(rep)
        except Exception as e:  # crafted data the renderer does not expect: say so, never a traceback
            raise ArtifactError(f"'{self.path}': {REPORT} is not an inspect report luisaml wrote "
                                f"({type(e).__name__}: {str(e)[:200]})") from None
        return rep

    @property
    def plan(self) -> Plan:
        """Return the plan generated from its data (no device); raise ArtifactError when the data does
        not check or the module does not hash to what the manifest records."""
        if self._plan is None:
            t = time.perf_counter()
            doc = parse_json(self.members[MODEL], MAX_MODEL_DEPTH, MODEL, self.path)
            plan = regenerate(doc, self.members[WEIGHTS], self.path)
            if _source_hash(plan.source) != self.manifest["source_sha256"]:
                raise ArtifactError(
                    f"'{self.path}': its data generates a module whose sha256 is {_source_hash(plan.source)[:16]}..., "
                    f"its manifest says {self.manifest['source_sha256'][:16]}...: it was built by another luisaml or "
                    "edited; refusing it (build it again with `luisaml build`)")
            self.seconds["rebuild"] = time.perf_counter() - t
            self._plan = plan
        return self._plan

    @property
    def source(self) -> str:
        """Return the generated module's source, generated again from the data (checked as `plan`)."""
        return self.plan.source


def _open_regular(where: str):
    """Return a binary file object of `where`, refusing what is not a regular file before it is
    opened for reading (a FIFO would block, /dev/zero never ends) and one larger than any artifact."""
    try:
        st = os.stat(where)
    except FileNotFoundError:
        raise ArtifactError(f"'{where}' does not exist") from None
    except OSError as e:
        raise ArtifactError(f"cannot read '{where}': {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a device, FIFO or socket)"
        raise ArtifactError(f"'{where}' is {kind}; a luisaml artifact is a .lml file")
    limit = max_total_bytes() + (1 << 20)
    if st.st_size > limit:
        raise ArtifactError(f"'{where}' holds {st.st_size:,} bytes, more than any artifact may ({limit:,})")
    try:  # (non-blocking and checked again: the path may have been swapped since the stat)
        fd = os.open(where, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise ArtifactError(f"cannot read '{where}': {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ArtifactError(f"'{where}' is not a regular file; a luisaml artifact is a .lml file")
    return os.fdopen(fd, "rb")


def read(path: str | os.PathLike) -> Artifact:
    """Return the artifact at `path` with every size, hash and the format checked; raise
    ArtifactError for a file that is not one or is damaged, IncompatibleArtifact for another
    format version. The model is not rebuilt here (Artifact.plan does that)."""
    where = os.fspath(path)
    t0 = time.perf_counter()
    with _open_regular(where) as f:
        try:
            z = zipfile.ZipFile(f)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
            raise ArtifactError(f"'{where}' is not a luisaml artifact (not a zip file); build one with "
                                f"`luisaml build MODEL -o FILE.lml` ({str(e)[:100]})") from None
        with z:
            infos = _check_zip(z, where)
            manifest = _read_manifest(z, infos, where)
            members = {name: _read_member(z, infos[name], where) for name in manifest["members"]}
    t1 = time.perf_counter()
    for name, info in manifest["members"].items():
        if hashlib.sha256(members[name]).hexdigest() != info["sha256"]:
            raise ArtifactError(f"'{where}' is damaged: the hash of its member '{name}' does not match its manifest")
    if content_hash(manifest) != manifest["content_hash"]:
        raise ArtifactError(f"'{where}' is damaged: its manifest does not match its content hash")
    return Artifact(where, manifest, members, {"read": t1 - t0, "hash": time.perf_counter() - t1})


def _check_zip(z: zipfile.ZipFile, where: str) -> dict[str, zipfile.ZipInfo]:
    """Return {name: ZipInfo} after checking the directory: the manifest first, known members
    once each, each and their total within bounds (declared sizes: before anything is read)."""
    infos = z.infolist()
    names = [i.filename for i in infos]
    if MANIFEST not in names:
        raise ArtifactError(f"'{where}' is not a luisaml artifact (a zip file without {MANIFEST})")
    limits = _member_limits()
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ArtifactError(f"'{where}' is damaged: its zip directory lists '{dup[0]}' {names.count(dup[0])} times")
    unknown = [n for n in names if n not in limits]
    if unknown:
        raise ArtifactError(f"'{where}': unknown member '{unknown[0][:200]}' (a format {FORMAT_VERSION} artifact holds "
                            f"{', '.join(limits)} only; nothing else is read, and a file with more is refused)")
    if names[0] != MANIFEST:
        raise ArtifactError(f"'{where}' is damaged: its first member is '{names[0]}', not {MANIFEST}")
    for i in infos:
        if i.file_size > limits[i.filename]:
            raise ArtifactError(f"'{where}': its member '{i.filename}' declares {i.file_size:,} bytes (at most "
                                f"{limits[i.filename]:,})")
        if i.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise ArtifactError(f"'{where}': its member '{i.filename}' uses compression method {i.compress_type} "
                                "(luisaml writes stored or deflated members)")
        if i.filename == WEIGHTS and (i.compress_type != zipfile.ZIP_STORED or i.compress_size != i.file_size):
            # (stored: the bytes it declares are in the file, so a small file cannot inflate to gigabytes)
            raise ArtifactError(f"'{where}': its member '{WEIGHTS}' is compressed or declares {i.file_size:,} bytes "
                                f"in {i.compress_size:,} (luisaml stores it as is)")
    total = sum(i.file_size for i in infos)
    if total > max_total_bytes():
        raise ArtifactError(f"'{where}': its members declare {total:,} bytes together (at most {max_total_bytes():,})")
    return {i.filename: i for i in infos}


def _read_manifest(z: zipfile.ZipFile, infos: dict, where: str) -> dict:
    m = parse_json(_read_member(z, infos[MANIFEST], where), MAX_MANIFEST_DEPTH, MANIFEST, where)
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ArtifactError(f"'{where}' is not a luisaml artifact ({MANIFEST} does not say format '{FORMAT}')")
    version = m.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ArtifactError(f"'{where}' is damaged: its manifest's format_version is {version!r} "
                            f"({type(version).__name__}), expected an integer")
    if version != FORMAT_VERSION:
        newer = version > FORMAT_VERSION
        built = m.get("built_with")
        by = built.get("luisaml") if isinstance(built, dict) and isinstance(built.get("luisaml"), str) else "?"
        why = ("upgrade luisaml" if newer else "build it again with `luisaml build` (format 1 carried the generated "
               "module, which this luisaml never runs)" if version == 1 else "build it again with `luisaml build`")
        raise IncompatibleArtifact(f"'{where}' is an artifact of format version {version}, this luisaml "
                                   f"({_luisaml_version()}) reads version {FORMAT_VERSION}: {why} "
                                   f"(built with luisaml {by[:40]})")
    _check_manifest(m, infos, where)
    return m


def _check_manifest(m: dict, infos: dict, where: str) -> None:
    """Raise ArtifactError unless the manifest has exactly format 2's keys, each of its type."""
    def bad(key: str, what: str):
        raise ArtifactError(f"'{where}' is damaged: its manifest's {key} field {what}")

    keys = ("format", "format_version", "built_with", "created", "backend", "model", "members", "source_sha256",
            "content_hash")
    unknown = sorted(set(m) - set(keys))
    if unknown:
        bad(repr(unknown[0])[:100], f"is not one format {FORMAT_VERSION} has ({', '.join(keys)})")
    for key in keys:
        if key not in m:
            bad(key, "is missing")
    for key in ("created", "model"):
        if not isinstance(m[key], str) or len(m[key]) > 4096:
            bad(key, f"is {type(m[key]).__name__}, expected a string (at most 4096 characters)")
    if m["backend"] not in BACKENDS:
        bad("backend", f"is {str(m['backend'])[:40]!r}; expected one of {', '.join(repr(b) for b in BACKENDS)}")
    for key in ("source_sha256", "content_hash"):
        if not isinstance(m[key], str) or not _HEX64.fullmatch(m[key]):
            bad(key, "is not a sha256 (64 lower-case hex digits)")
    built = m["built_with"]
    if not isinstance(built, dict) or set(built) != {"luisaml", "luisa_python", "python", "numpy", "shaders"}:
        bad("built_with", "is not {luisaml, luisa_python, python, numpy, shaders}")
    if not all(isinstance(built[k], str) and len(built[k]) <= 100 for k in ("luisaml", "luisa_python", "python", "numpy")):
        bad("built_with", "holds a version that is not a string")
    shaders = built["shaders"]
    if not isinstance(shaders, dict) or not all(
            isinstance(k, str) and re.fullmatch(r"\w{1,100}", k) and isinstance(v, str) and _HEX64.fullmatch(v)
            for k, v in shaders.items()):
        bad("built_with.shaders", "is not {shader library: sha256}")
    members = m["members"]
    if not isinstance(members, dict):
        bad("members", "is not an object")
    for name in (MODEL, WEIGHTS):
        if name not in members:
            bad("members", f"does not list '{name}'")
    for name, info in members.items():
        if name not in infos or name == MANIFEST:
            bad("members", f"lists '{str(name)[:100]}', which the zip file does not hold (or may not)")
        if not isinstance(info, dict) or set(info) != {"sha256", "bytes"} or not isinstance(info["sha256"], str) \
                or not _HEX64.fullmatch(info["sha256"]) or not isinstance(info["bytes"], int) or isinstance(info["bytes"], bool):
            bad(f"members['{name}']", "is not {sha256, bytes}")
        if info["bytes"] != infos[name].file_size:
            bad(f"members['{name}'].bytes", f"says {info['bytes']}, the zip file holds {infos[name].file_size} bytes")
    extra = sorted(set(infos) - set(members) - {MANIFEST})
    if extra:
        bad("members", f"does not list '{extra[0]}', which the zip file holds")


def _read_member(z: zipfile.ZipFile, zi: zipfile.ZipInfo, where: str) -> bytes:
    try:
        with z.open(zi) as f:  # (at most the declared size, checked against the limits before)
            raw = f.read(zi.file_size + 1)
    # a CRC error, a cut file, a corrupt deflate stream (zlib.error: which one depends on where the damage is)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, zlib.error, NotImplementedError) as e:
        raise ArtifactError(f"'{where}' is damaged: its member '{zi.filename}' cannot be read ({e})") from None
    if len(raw) != zi.file_size:
        raise ArtifactError(f"'{where}' is damaged: its member '{zi.filename}' holds {len(raw)} bytes, its zip "
                            f"directory says {zi.file_size}")
    return raw


def check_compatible(art: Artifact, backend: str) -> None:
    """Raise IncompatibleArtifact when this process cannot run the artifact exactly as built:
    another backend, luisaml or luisa-python version."""
    built = art.built_with
    if art.backend != backend:
        raise IncompatibleArtifact(
            f"'{art.path}' was built for the {art.backend} backend and cannot run on {backend}: build it there with "
            f"`luisaml build MODEL --backend {backend} -o FILE.lml`")
    here = {"luisaml": _luisaml_version(), "luisa_python": _dist_version("luisa-python")}
    for key, what in (("luisaml", "luisaml"), ("luisa_python", "luisa-python")):
        if built.get(key) != here[key]:
            raise IncompatibleArtifact(
                f"'{art.path}' was built with {what} {built.get(key)}, this process has {what} {here[key]}: "
                "build it again here (the module is generated by the exact versions it was built with)")


def _warn_changed_shaders(art: Artifact, source: str) -> None:
    """Log a warning when a shader library the module imports changed since the build (its outputs
    may then differ from the build's)."""
    changed = [k for k, h in _shader_hashes(source).items() if art.built_with["shaders"].get(k) != h]
    if changed:
        logger.warning("'%s': the shader librar%s %s changed since it was built; its outputs may differ from the "
                       "build's: build it again", art.path, "y" if len(changed) == 1 else "ies",
                       ", ".join(f"luisaml.shaders.{k}" for k in changed))


def load(path: str | os.PathLike, *, backend: str | None = None) -> CompiledNetwork:
    """Return the network a .lml artifact describes, generated again from its data and ready to run
    as it was when built (same `run`, `forward`, `profile`); it imports neither onnx nor torch, and
    runs nothing from the file.

    backend: None (the backend it was built for), or "cpu"/"cuda", which must be that one (as must
    the backend the process already runs, if it does). Raises ArtifactError for a file that is not
    an artifact, is damaged or whose data does not generate the module it records;
    IncompatibleArtifact for another format, luisaml or luisa-python version or backend."""
    if not isinstance(path, (str, os.PathLike)):
        raise UsageError(f"luisaml.load takes the path of a .lml file, not {type(path).__name__}")
    if backend not in (None, "auto", "cpu", "cuda"):
        raise UsageError(f"luisaml.load's backend must be None, 'auto', 'cpu' or 'cuda', not {backend!r}")
    with phase("artifact load", path=os.fspath(path)):
        art = read(path)
        # the process's device when it runs one already (LuisaCompute allows one per process)
        want = (device.current() or art.backend) if backend in (None, "auto") else backend
        check_compatible(art, want)
        plan = art.plan
        _warn_changed_shaders(art, plan.source)
        t = time.perf_counter()
        name = device.init(art.backend)
        art.seconds["device init"] = time.perf_counter() - t
        t = time.perf_counter()
        # luisaml's own emission of checked data, written and imported as compile() does (runtime._network)
        module_path = cache.write_module(plan.source)
        module = cache.import_module(module_path)
        art.seconds["module import"] = time.perf_counter() - t
        net = CompiledNetwork(plan, module, str(module_path), name, save=save)
        net.artifact = art
    return net


def is_artifact(path) -> bool:
    """True when `path` names a .lml file (by its suffix, or a regular file that is a zip whose first
    member is the manifest)."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    if os.fspath(path).endswith(SUFFIX):
        return True
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        with open(path, "rb") as f:
            head = f.read(30 + len(MANIFEST))
    except (OSError, ValueError):
        return False
    return head[:4] == b"PK\x03\x04" and head[30:30 + len(MANIFEST)] == MANIFEST.encode()


__all__ = ["FORMAT", "FORMAT_VERSION", "SUFFIX", "Artifact", "save", "load", "read", "regenerate", "is_artifact",
           "check_compatible", "content_hash", "built_with", "ArtifactError", "IncompatibleArtifact"]
