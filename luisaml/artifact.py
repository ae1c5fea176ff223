"""The .lml artifact: one file holding everything a compiled network needs to run (the generated
module, the weight blob, the IO specs, the plan's stages and buffers, the allocation and inspect
reports, the versions it was built with and a content hash), how `net.save` writes it, how
`luisaml.load` checks and runs it without onnx or torch, and how `luisaml inspect` reads it.

The format (README.md, "The .lml artifact") is a zip file:

- `manifest.json` (first): `format` "luisaml-artifact", `format_version` (FORMAT_VERSION),
  `built_with` (luisaml, luisa-python, Python, numpy versions, and a hash of each shader library
  the module imports), `backend`, `model`, `created`, `members` ({name: {sha256, bytes}}),
  `network` (what the runtime binds: IO specs, kernels, stages and their dispatch sizes, pooled
  buffers, scratch, run-time checks, limits, the weight layout, host outputs), and
  `content_hash`: the sha256 of the manifest written without that key (canonical JSON), which
  covers every member through its sha256;
- `module.py`: the generated module, exactly as compile() wrote it to its cache;
- `weights.bin`: the weight blob (stored, not compressed);
- `report.json`: the inspect report (luisaml/report.py, schema 1), for `luisaml inspect m.lml`;
- `const/<k>.npy`: constants the graph passes straight to an output.

No pickle anywhere: JSON, raw bytes, and .npy read with allow_pickle=False. A .lml holds code
(the module is imported), so `load` parses the module with safe_source's whitelist before it is
written to the cache and imported, as compile() does; the hash finds damage, not malice.

Compiled kernel binaries are not in the file: luisa-python 0.3.7 can save a shader
(`DeviceInterface.save_shader`) but has no call to load one, so every process rebuilds its
kernels from the module's source (its AST walk, then LuisaCompute's compile, which on the CPU
backend is a JIT of LLVM bitcode it caches beside the Python executable under a hash of the
generated C++ that Python cannot compute); benchmarks/NOTES.md has the measurements."""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import io
import json
import os
import re
import sys
import time
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np

from . import cache, device, dtypes
from .errors import ArtifactError, IncompatibleArtifact, LuisamlError, UsageError
from .limits import Limits
from .log import logger, phase
from .network import CompiledNetwork, PerBatchNetwork
from .plan import Blob, IOSpec
from .regalloc import Allocation, Slot

if TYPE_CHECKING:
    from .plan import Plan

FORMAT = "luisaml-artifact"
FORMAT_VERSION = 1
SUFFIX = ".lml"
MANIFEST, MODULE, WEIGHTS, REPORT = "manifest.json", "module.py", "weights.bin", "report.json"
# bounds on what a manifest may make load() read before any hash is checked
MAX_MANIFEST_BYTES = 64 << 20
MAX_MODULE_BYTES = 512 << 20
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SHADER_IMPORT = re.compile(r"^from luisaml\.shaders\.(\w+) import", re.MULTILINE)


# ---- versions -------------------------------------------------------------------------------
def _dist_version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _luisaml_version() -> str:
    from . import __version__

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


# ---- what the runtime reads of a plan, as data ------------------------------------------------
def _io_to_data(s: IOSpec) -> dict[str, Any]:
    return {"name": s.name, "ident": s.ident, "dtype": s.dtype.name, "as_float": s.dtype.computes_as_float,
            "shape": list(s.shape), "kernel_shape": list(s.kernel_shape), "batched": s.batched,
            "accumulated": s.accumulated}


def _dtype(name: str, as_float: bool, where: str) -> dtypes.DType:
    if name == "DOUBLE" and as_float:
        return dtypes.DOUBLE_AS_FLOAT
    for d in dtypes.SUPPORTED.values():
        if d.name == name:
            return d
    raise ArtifactError(f"{where}: unknown element type {name!r}")


def _io_from_data(d: dict, where: str) -> IOSpec:
    if not _IDENT.fullmatch(str(d["ident"])):
        raise ArtifactError(f"{where}: {d['ident']!r} is not an identifier")
    return IOSpec(str(d["name"]), d["ident"], _dtype(d["dtype"], bool(d.get("as_float")), where),
                  tuple(d["shape"]), tuple(int(k) for k in d["kernel_shape"]), bool(d["batched"]),
                  bool(d.get("accumulated", False)))


def _allocation_to_data(a: Allocation) -> dict[str, Any]:
    return {"slots": [{"id": s.id, "space": s.space, "dtype": s.dtype, "size": s.size, "itemsize": s.itemsize,
                       "members": list(s.members)} for s in a.slots],
            "slot_of": dict(a.slot_of), "live": {k: list(v) for k, v in a.live.items()},
            "inplace": [list(p) for p in a.inplace], "views": [list(p) for p in a.views],
            "bytes_unpooled": a.bytes_unpooled}


def _allocation_from_data(d: dict) -> Allocation:
    return Allocation([Slot(int(s["id"]), s["space"], s["dtype"], int(s["size"]), int(s["itemsize"]), list(s["members"]))
                       for s in d["slots"]],
                      {k: int(v) for k, v in d["slot_of"].items()}, {k: (int(a), int(b)) for k, (a, b) in d["live"].items()},
                      [tuple(p) for p in d["inplace"]], [tuple(p) for p in d["views"]], int(d["bytes_unpooled"]))


def _fused_dispatch(n: int, tile: int, threads: int, blocks_per_sm: int, mode: str) -> int:
    """FusedMLP.dispatch_size as data: whole blocks, one persistent block per slot an SM may hold
    (CUDA), or up to 4 tiles per CPU core (emulated); tests/test_artifact.py holds them equal."""
    if not n:
        return 0
    tiles = -(-n // tile)
    if mode == "gpu":
        return max(min(tiles, device.sm_count() * blocks_per_sm), 1) * threads
    return max(min(tiles, 4 * (os.cpu_count() or 1)), 1)


def _grouped_dispatch(n: int, samples: int, per_group: int) -> int:
    """Threads a blocks stage of sample groups dispatches for n samples (schedule.Stage.dispatch)."""
    return -(-n // samples) * per_group


def _dispatch_to_data(st) -> dict[str, Any]:
    """Return how many threads a stage dispatches for n samples, as data: `per_sample`·n +
    `fixed` for every stage but the fused MLP's, whose count depends on the machine's cores."""
    if st.domain == "fused":
        op = st.root[1]
        d = {"fused": {"tile": op.T, "threads": op.NT, "blocks_per_sm": op.blocks_per_sm, "mode": op.mode}}
        ok = all(_fused_dispatch(n, **d["fused"]) == st.dispatch(n) for n in (0, 1, 7, 129, 100_000))
    elif st.grouped:  # ceil(n / samples) groups of `per_group` threads (a Winograd product's blocks)
        d = {"groups": {"samples": st.samples, "per_group": st.items * st.threads}}
        ok = all(_grouped_dispatch(n, **d["groups"]) == st.dispatch(n) for n in (0, 1, 7, 129, 100_000))
    else:
        fixed = st.dispatch(0)
        d = {"per_sample": st.dispatch(1) - fixed, "fixed": fixed}
        ok = all(st.dispatch(n) == d["per_sample"] * n + fixed for n in (2, 3, 17, 1000))
    if not ok:
        raise UsageError(f"cannot save stage {st.index} ({st.domain}): its dispatch size is not one the artifact "
                         "format can write (per_sample * n + fixed, or the fused MLP's)")
    return d


@dataclass
class StoredStage:
    """A stage as the runtime launches it: its index, domain, the line inspect prints, and its
    dispatch size for n samples."""

    index: int
    domain: str
    line: str
    dispatch_data: dict

    def dispatch(self, n: int) -> int:
        """Threads to dispatch for n samples."""
        fused = self.dispatch_data.get("fused")
        if fused is not None:
            return _fused_dispatch(n, int(fused["tile"]), int(fused["threads"]), int(fused["blocks_per_sm"]),
                                   str(fused["mode"]))
        groups = self.dispatch_data.get("groups")
        if groups is not None:
            return _grouped_dispatch(n, int(groups["samples"]), int(groups["per_group"]))
        return int(self.dispatch_data["per_sample"]) * n + int(self.dispatch_data["fixed"])

    def describe(self) -> str:
        """One line for inspect."""
        return self.line


@dataclass
class StoredSchedule:
    """The stages in launch order and the pooled buffers across them."""

    stages: list[StoredStage]
    buffers: Allocation

    @property
    def takes_batch(self) -> bool:
        """Whether the kernels take the batch size (schedule.Schedule.takes_batch): the fused MLP's,
        and a blocks stage of sample groups."""
        return any(st.domain == "fused" or "groups" in st.dispatch_data for st in self.stages)

    def describe(self) -> str:
        """Return the stages' lines and the buffer allocation, as Schedule.describe does."""
        return "\n".join([s.describe() for s in self.stages] + ["buffers: " + self.buffers.report()])


@dataclass
class StoredGraph:
    """The graph's input and output names, and the constants it passes straight to an output."""

    inputs: list[str]
    outputs: list[str]
    constants: dict[str, np.ndarray] = field(default_factory=dict)

    def var(self, name: str):
        """Return the variable `name` as Graph.var does, as far as the runtime reads it (name, value)."""
        return SimpleNamespace(name=name, value=self.constants.get(name))


@dataclass
class StoredPlan:
    """What a CompiledNetwork reads of its Plan (network.py), restored from an artifact: no model,
    no operators, nothing that imports onnx."""

    symbol: str | None
    inputs: list[IOSpec]
    outputs: list[IOSpec]
    blob: Blob
    source: str
    kernels: list[str]
    merged_stages: bool
    checks: list[str]
    limits: Limits
    kernel_scratch: dict[str, int]
    schedule: StoredSchedule | None
    allocation: Allocation
    model: SimpleNamespace  # .graph: StoredGraph
    fused: SimpleNamespace | None  # .precision of the fused MLP kernel
    host_outputs: list[str]
    fusion_note: str = ""
    plan_note: str = ""
    derived: list = field(default_factory=list)  # (an artifact never holds host-derived inputs)
    stage_kernels: list = field(default_factory=list)  # Plan.stage_kernels
    readbacks: list = field(default_factory=list)  # (nor outputs sized at run time)
    voxel_rows: list = field(default_factory=list)  # (nor grids bound at run time: they need derived inputs)


def _blob_from(raw: bytes, layout: dict) -> Blob:
    blob = Blob()
    blob.parts, blob.size = [raw], len(raw)
    for name, (offset, nbytes, dt, shape) in layout.items():
        blob.layout[name] = (int(offset), int(nbytes), _dtype(dt, False, f"weight '{name}'"), tuple(shape))
    return blob


def network_data(plan) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Return (the manifest's `network` entry, {member name: constant}) for a plan (a Plan, or the
    StoredPlan of a loaded network)."""
    g = plan.model.graph
    sched = plan.schedule
    if getattr(plan, "host_steps", None) is not None:
        raise UsageError(
            f"cannot save a network whose grid ops run as steps before the kernels ({plan.host_steps.steps[0].node.describe()} "
            "builds a grid from one bound at run time, driven from Python): an artifact holds kernels and static data only")
    if getattr(plan, "readbacks", None):
        raise UsageError(
            f"cannot save a network with outputs sized at run time ({plan.readbacks[0].node}: count, prefix sum, "
            "host read-back, fill): the artifact format stores static shapes only")
    if plan.derived:
        raise UsageError(
            "cannot save a network with host-derived inputs (" + ", ".join(d.ident for d in plan.derived)
            + "): an operator computes them on the host in Python (fVDB grid metadata), which an artifact cannot hold")
    consts: dict[str, np.ndarray] = {}
    host: dict[str, str] = {}
    for name in plan.host_outputs:
        if name in g.inputs:
            host[name] = "input"
        else:
            member = f"const/{len(consts)}.npy"
            consts[member] = np.asarray(g.var(name).value)
            host[name] = member
    data = {
        "symbol": plan.symbol,
        "inputs": [_io_to_data(s) for s in plan.inputs],
        "outputs": [_io_to_data(s) for s in plan.outputs],
        "graph_inputs": list(g.inputs),
        "graph_outputs": list(g.outputs),
        "host_outputs": host,
        "kernels": list(plan.kernels),
        "merged_stages": bool(plan.merged_stages),
        "stage_kernels": list(plan.stage_kernels),
        "checks": list(plan.checks),
        "limits": dataclasses.asdict(plan.limits),
        "kernel_scratch": dict(plan.kernel_scratch),
        "precision": plan.fused.precision if plan.fused is not None else None,
        "stages": None if sched is None else [
            {"index": st.index, "domain": st.domain, "describe": st.describe(),
             "dispatch": st.dispatch_data if isinstance(st, StoredStage) else _dispatch_to_data(st)}
            for st in sched.stages],
        "buffers": None if sched is None else _allocation_to_data(sched.buffers),
        "registers": _allocation_to_data(plan.allocation),
        "weight_layout": {k: [o, n, d.name, list(s)] for k, (o, n, d, s) in plan.blob.layout.items()},
        "fusion_note": plan.fusion_note or "",
        "plan_note": plan.plan_note or "",
    }
    return data, consts


def plan_from_data(d: dict, source: str, weights: bytes, consts: dict[str, np.ndarray]) -> StoredPlan:
    """Return the StoredPlan of a manifest's `network` entry; raise ArtifactError for one that does
    not fit together (a kernel name that is no identifier, an unknown dtype)."""
    for k in d["kernels"]:
        if not _IDENT.fullmatch(str(k)):
            raise ArtifactError(f"kernel name {k!r} is not an identifier")
    unknown = [k for k in d.get("stage_kernels", []) if k not in d["kernels"]]
    if unknown or (d.get("stage_kernels") and len(d["stage_kernels"]) != len(d["stages"] or [])):
        raise ArtifactError(f"stage_kernels {d.get('stage_kernels')!r} do not fit the kernels and stages")
    inputs = [_io_from_data(s, f"input '{s.get('name')}'") for s in d["inputs"]]
    outputs = [_io_from_data(s, f"output '{s.get('name')}'") for s in d["outputs"]]
    schedule = None
    if d["stages"] is not None:
        schedule = StoredSchedule([StoredStage(int(s["index"]), str(s["domain"]), str(s["describe"]), dict(s["dispatch"]))
                                   for s in d["stages"]], _allocation_from_data(d["buffers"]))
    constants = {}
    for name, where in d["host_outputs"].items():
        if where != "input":
            if where not in consts:
                raise ArtifactError(f"output '{name}': member {where!r} is missing")
            constants[name] = consts[where]
    graph = StoredGraph(list(d["graph_inputs"]), list(d["graph_outputs"]), constants)
    return StoredPlan(
        symbol=d["symbol"], inputs=inputs, outputs=outputs, blob=_blob_from(weights, d["weight_layout"]), source=source,
        kernels=list(d["kernels"]), merged_stages=bool(d["merged_stages"]), checks=[str(c) for c in d["checks"]],
        stage_kernels=[str(k) for k in d.get("stage_kernels", [])],
        limits=Limits(**{f.name: int(d["limits"][f.name]) for f in dataclasses.fields(Limits) if f.name in d["limits"]}),
        kernel_scratch={str(k): int(v) for k, v in d["kernel_scratch"].items()}, schedule=schedule,
        allocation=_allocation_from_data(d["registers"]), model=SimpleNamespace(graph=graph),
        fused=SimpleNamespace(precision=d["precision"]) if d["precision"] else None,
        host_outputs=list(d["host_outputs"]), fusion_note=str(d.get("fusion_note", "")),
        plan_note=str(d.get("plan_note", "")))


# ---- writing --------------------------------------------------------------------------------
def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def content_hash(manifest: dict) -> str:
    """Return the sha256 of a manifest without its `content_hash` key (canonical JSON)."""
    return hashlib.sha256(_canonical({k: v for k, v in manifest.items() if k != "content_hash"})).hexdigest()


def _npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def save(net: CompiledNetwork, path: str | os.PathLike, *, model_name: str | None = None) -> Path:
    """Write the network as one .lml file at `path` (atomically) and return the path; raise
    UsageError for a network an artifact cannot hold (one compiled per batch size, one with
    host-derived inputs)."""
    if isinstance(net, PerBatchNetwork):
        raise UsageError(
            f"cannot save a network that compiles per batch size ({net.why}); fix the batch size with "
            "input_shapes (--input-shapes NAME:DIMxDIM...) and batch_axis=None (--batch-axis none) to build one "
            "network")
    plan = net.plan
    stored = net.artifact  # a loaded network saves what it was loaded from
    name = model_name or (stored.model if stored is not None else None) or (plan.model.graph.name or "model")
    with phase("artifact save", path=os.fspath(path)):
        data, consts = network_data(plan)
        members: dict[str, bytes] = {MODULE: plan.source.encode(), WEIGHTS: net.weight_bytes()}
        report_data = stored.report if stored is not None else _report(plan, name)
        if report_data is not None:
            members[REPORT] = json.dumps(report_data, indent=1).encode()
        for member, value in consts.items():
            members[member] = _npy_bytes(value)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "built_with": stored.built_with if stored is not None else built_with(plan.source),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "backend": net.backend,
            "model": name,
            "members": {k: {"sha256": hashlib.sha256(v).hexdigest(), "bytes": len(v)} for k, v in members.items()},
            "network": data,
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
@dataclass
class Artifact:
    """A .lml file read and checked (hashes, format version): its manifest and members."""

    path: str
    manifest: dict
    members: dict[str, bytes]
    seconds: dict[str, float] = field(default_factory=dict)  # read, hash: where load's time went

    @property
    def backend(self) -> str:
        """Return the backend it was built for ("cpu" or "cuda"): the only one it runs on."""
        return self.manifest["backend"]

    @property
    def model(self) -> str:
        """Return the name of the model it was built from."""
        return self.manifest.get("model", "model")

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
        """Return the inspect report made when it was built (luisaml/report.py, schema 1), or None."""
        raw = self.members.get(REPORT)
        return json.loads(raw) if raw is not None else None

    @property
    def source(self) -> str:
        """Return the generated module's source; raise ArtifactError when it is not ASCII."""
        try:
            return self.members[MODULE].decode("ascii")
        except UnicodeDecodeError:
            raise ArtifactError(f"'{self.path}': its module is not ASCII text (luisaml generates ASCII only)") from None


def read(path: str | os.PathLike) -> Artifact:
    """Return the artifact at `path` with every hash and the format checked; raise ArtifactError
    for a file that is not one or is damaged, IncompatibleArtifact for another format version."""
    where = os.fspath(path)
    t0 = time.perf_counter()
    try:
        z = zipfile.ZipFile(where)
    except zipfile.BadZipFile:
        raise ArtifactError(f"'{where}' is not a luisaml artifact (not a zip file); build one with "
                            "`luisaml build MODEL -o FILE.lml`") from None
    with z:
        manifest = _read_manifest(z, where)
        members: dict[str, bytes] = {}
        for name, info in manifest["members"].items():
            members[name] = _read_member(z, name, info, where)
    t1 = time.perf_counter()
    for name, info in manifest["members"].items():
        if hashlib.sha256(members[name]).hexdigest() != info.get("sha256"):
            raise ArtifactError(f"'{where}' is damaged: the hash of its member '{name}' does not match its manifest")
    if content_hash(manifest) != manifest.get("content_hash"):
        raise ArtifactError(f"'{where}' is damaged: its manifest does not match its content hash")
    t2 = time.perf_counter()
    for need in (MODULE, WEIGHTS):
        if need not in members:
            raise ArtifactError(f"'{where}' has no '{need}'")
    return Artifact(where, manifest, members, {"read": t1 - t0, "hash": t2 - t1})


def _read_manifest(z: zipfile.ZipFile, where: str) -> dict:
    try:
        info = z.getinfo(MANIFEST)
    except KeyError:
        raise ArtifactError(f"'{where}' is not a luisaml artifact (a zip file without {MANIFEST})") from None
    if info.file_size > MAX_MANIFEST_BYTES:
        raise ArtifactError(f"'{where}': {MANIFEST} declares {info.file_size} bytes (at most {MAX_MANIFEST_BYTES})")
    try:
        manifest = json.loads(z.read(info))
    except (ValueError, zipfile.BadZipFile, OSError, EOFError, zlib.error) as e:
        raise ArtifactError(f"'{where}' is damaged: {MANIFEST} cannot be read ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"'{where}' is not a luisaml artifact ({MANIFEST} does not say format '{FORMAT}')")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        raise IncompatibleArtifact(
            f"'{where}' is an artifact of format version {version}, this luisaml ({_luisaml_version()}) reads version "
            f"{FORMAT_VERSION}: " + ("upgrade luisaml" if newer else "build it again with this luisaml")
            + f" (built with luisaml {manifest.get('built_with', {}).get('luisaml', '?')})")
    for key, kind in (("members", dict), ("network", dict), ("built_with", dict), ("backend", str),
                      ("content_hash", str)):
        if not isinstance(manifest.get(key), kind):
            raise ArtifactError(f"'{where}' is damaged: its manifest has no '{key}' {kind.__name__}")
    if not all(isinstance(v, dict) for v in manifest["members"].values()):
        raise ArtifactError(f"'{where}' is damaged: its manifest's members are not {{name: {{sha256, bytes}}}}")
    return manifest


def _read_member(z: zipfile.ZipFile, name: str, info: dict, where: str) -> bytes:
    limit = MAX_MODULE_BYTES if name == MODULE else Limits().weight_bytes
    try:
        zi = z.getinfo(name)
    except KeyError:
        raise ArtifactError(f"'{where}' is damaged: its member '{name}' is missing") from None
    if zi.file_size != info.get("bytes") or zi.file_size > limit:
        raise ArtifactError(f"'{where}' is damaged: its member '{name}' holds {zi.file_size} bytes, its manifest "
                            f"says {info.get('bytes')}")
    try:
        return z.read(zi)
    # a CRC error, a cut file, a corrupt deflate stream (zlib.error: which one depends on where the damage is)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, zlib.error) as e:
        raise ArtifactError(f"'{where}' is damaged: its member '{name}' cannot be read ({e})") from None


def check_compatible(art: Artifact, backend: str) -> None:
    """Raise IncompatibleArtifact when this process cannot run the artifact exactly as built:
    another backend, luisaml or luisa-python version; log a warning when a shader library it
    imports changed since (its outputs may then differ from the build's)."""
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
                "build it again here (the generated module is written for the exact versions it was built with)")
    changed = [k for k, h in _shader_hashes(art.source).items() if built.get("shaders", {}).get(k) != h]
    if changed:
        logger.warning("'%s': the shader librar%s %s changed since it was built; its outputs may differ from the "
                       "build's: build it again", art.path, "y" if len(changed) == 1 else "ies",
                       ", ".join(f"luisaml.shaders.{k}" for k in changed))


def _constants(art: Artifact) -> dict[str, np.ndarray]:
    out = {}
    for name, raw in art.members.items():
        if name.startswith("const/"):
            try:
                out[name] = np.load(io.BytesIO(raw), allow_pickle=False)
            except ValueError as e:
                raise ArtifactError(f"'{art.path}': member '{name}' is not a .npy array ({e})") from None
    return out


def _module_of(art: Artifact):
    """Import the artifact's module through luisaml's cache: a module not already there is first
    parsed by safe_source's whitelist (as compile() does before it writes one), so a .lml whose
    module holds anything luisaml does not generate is refused, never run."""
    from .safe_source import check_source

    source = art.source
    path = cache.find_module(source)
    if path is None:
        t = time.perf_counter()
        try:
            check_source(source)
        except LuisamlError as e:
            raise ArtifactError(f"'{art.path}': its module is not one luisaml generates, refusing to load it: {e}") from None
        art.seconds["source check"] = time.perf_counter() - t
        path = cache.write_module(source)
    t = time.perf_counter()
    module = cache.import_module(path)
    art.seconds["module exec"] = time.perf_counter() - t
    return module, path


def load(path: str | os.PathLike, *, backend: str | None = None) -> CompiledNetwork:
    """Return the network a .lml artifact holds, ready to run as it was when built (same `run`,
    `forward`, `profile`); it imports neither onnx nor torch.

    backend: None (the backend it was built for), or "cpu"/"cuda", which must be that one (as must
    the backend the process already runs, if it does). Raises
    ArtifactError for a file that is not an artifact, is damaged or holds a module luisaml does
    not generate; IncompatibleArtifact for another format, luisaml or luisa-python version or
    backend."""
    if not isinstance(path, (str, os.PathLike)):
        raise UsageError(f"luisaml.load takes the path of a .lml file, not {type(path).__name__}")
    with phase("artifact load", path=os.fspath(path)):
        art = read(path)
        # the process's device when it runs one already (LuisaCompute allows one per process)
        want = (device.current() or art.backend) if backend in (None, "auto") else backend
        if want not in ("cpu", "cuda"):
            raise UsageError(f"backend must be None, 'auto', 'cpu' or 'cuda', not {backend!r}")
        check_compatible(art, want)
        t = time.perf_counter()
        name = device.init(art.backend)
        art.seconds["device init"] = time.perf_counter() - t
        try:
            plan = plan_from_data(art.manifest["network"], art.source, art.members[WEIGHTS], _constants(art))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, LuisamlError):
                raise
            raise ArtifactError(f"'{art.path}': its manifest's network entry is malformed ({type(e).__name__}: {e})") from None
        module, module_path = _module_of(art)
        missing = [k for k in plan.kernels + ["forward"] if not hasattr(module, k)]
        if missing:
            raise ArtifactError(f"'{art.path}': its module has no {', '.join(missing)}")
        net = CompiledNetwork(plan, module, str(module_path), name)
        net.artifact = art
    return net


def is_artifact(path) -> bool:
    """True when `path` names a .lml file (by its suffix, or a zip whose first member is the manifest)."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    if os.fspath(path).endswith(SUFFIX):
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(30 + len(MANIFEST))
    except OSError:
        return False
    return head[:4] == b"PK\x03\x04" and head[30:30 + len(MANIFEST)] == MANIFEST.encode()


__all__ = ["FORMAT", "FORMAT_VERSION", "SUFFIX", "Artifact", "save", "load", "read", "is_artifact",
           "check_compatible", "content_hash", "built_with", "StoredPlan", "ArtifactError", "IncompatibleArtifact"]
