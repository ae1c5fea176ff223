"""The command line: `luisaml build MODEL -o FILE.lml`, `luisaml run | inspect | emit | bench MODEL`
(an .onnx or .json model, or a built .lml artifact) and `luisaml cache info | clear`,
with their logging (-v, -q) and exit codes: 0 done, 2 bad input (a model, file, argument or
setting luisaml refuses: one line `luisaml: error: ...` on stderr), 1 an internal error (one line;
-v adds the traceback), 3 when `run --compare` finds an output past --atol/--rtol, 141 when the reader of stdout went away (`luisaml emit m.onnx | head`),
130 on Ctrl-C. `inspect` also exits 1 when the model has nodes luisaml cannot compile."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
import traceback

import numpy as np

from . import cli_args
from .errors import LuisamlError, UsageError
from .compare import compare_outputs, onnxruntime_outputs
from .log import logger, note, phase
from .memory import bench_batch, mib

# what a runtime-only install may lack (the .lml runs without them), by import name -> pip's name
OPTIONAL_PACKAGES = {"onnx": "onnx", "onnxruntime": "onnxruntime", "torch": "torch", "safetensors": "safetensors"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, like every other error (argparse prints usage too)
        self.exit(2, f"luisaml: error: {message} (see '{self.prog} --help')\n")


def _version() -> str:
    from importlib import metadata

    from . import __version__

    def v(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    return (f"luisaml {__version__} (onnx {v('onnx')}, luisa-python {v('luisa-python')}, "
            f"Python {sys.version.split()[0]})")


# ---- arguments -------------------------------------------------------------------------------
def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="an .onnx file or a LuisaML .json model (run, inspect, emit, bench: or a built .lml)")
    p.add_argument("--weights", "-w", help="a safetensors file or a header-less weight blob")
    p.add_argument("--batch-axis", default="auto", choices=["auto", "0", "none"],
                   help="auto: one thread per sample along the dynamic leading dimension of an input and an "
                        "output; 0: along the inputs' dynamic leading dimension; none: one instance of the graph "
                        "(dims written -1, '?' or unnamed count as dynamic)")
    p.add_argument("--input-shapes", action="append", metavar="NAME:DIMxDIM,...",
                   help="fix input dimensions, trtexec style: x:1x3x48x192,y:4 (repeatable); ? or -1 keeps a "
                        "dimension dynamic, e.g. x:?x3x48x192 keeps the batch")


def _batch_axis(s: str):
    return {"auto": "auto", "0": 0, "none": None}[s]


def parse_input_shapes(items: list[str] | None) -> dict[str, list[int | None]] | None:
    """Return {name: dims} of --input-shapes values ('x:1x3x48x192,y:4'; ? or -1 is None: kept as
    the model has it); a name may contain ':' (the last one separates the dims)."""
    shapes: dict[str, list[int | None]] = {}
    for item in items or []:
        for part in item.split(","):
            if not part.strip():
                continue
            name, sep, dims = part.strip().rpartition(":")
            name = name.strip().strip("'\"")
            if not sep or not name:
                raise UsageError(f"--input-shapes expects NAME:DIMxDIM..., e.g. x:1x3x224x224, got {part.strip()!r}")
            shape: list[int | None] = []
            for d in dims.strip().split("x") if dims.strip() not in ("", "scalar") else []:
                d = d.strip()
                if d in ("?", "-1"):
                    shape.append(None)
                elif d.isdigit():
                    shape.append(int(d))
                else:
                    raise UsageError(f"--input-shapes {part.strip()!r}: dimension {d!r} is not a number "
                                   "(? keeps a dimension dynamic)")
            if name in shapes and shapes[name] != shape:
                raise UsageError(f"--input-shapes gives '{name}' twice: {shapes[name]} and {shape}")
            shapes[name] = shape
    return shapes or None


def checked_input_shapes(model, weights, items: list[str] | None) -> dict[str, list[int | None]] | None:
    """Return parse_input_shapes(items) after checking each fixed dimension against the model's
    own: a dimension the model fixes (x is [?, 4]) cannot be given another value (x:2x5); the
    model's rank must match. A built .lml is not read here (its shapes were fixed when built)."""
    shapes = parse_input_shapes(items)
    if not shapes or not str(model).endswith((".onnx", ".json")) or not os.path.isfile(model):
        return shapes
    from .passes.infer import input_shapes as declared_shapes

    if str(model).endswith(".onnx"):
        import onnx

        proto = onnx.load(str(model), load_external_data=False)  # the graph's inputs only: no weights read
    else:
        from .loaders import load_proto

        proto = load_proto(model, weights)
    declared = declared_shapes(proto)
    for name, shape in shapes.items():
        dims = declared.get(name)
        if dims is None:
            continue  # set_input_shapes names the graph inputs
        given = "x".join("?" if d is None else str(d) for d in shape)
        model_dims = "[" + ", ".join("?" if not isinstance(d, int) else str(d) for d in dims) + "]"
        if len(dims) != len(shape):
            raise UsageError(f"--input-shapes {name}:{given} has rank {len(shape)}, the model's input '{name}' "
                             f"is {model_dims} (rank {len(dims)})")
        for k, (want, got) in enumerate(zip(dims, shape)):
            if isinstance(want, int) and got is not None and got != want:
                raise UsageError(f"--input-shapes {name}:{given}: dimension {k} is {got}, which conflicts with the "
                                 f"model's {want} (input '{name}' is {model_dims}; only its ? dimensions can be fixed)")
    return shapes


_NPY_MAGIC, _ZIP_MAGIC = b"\x93NUMPY", b"PK\x03\x04"


def _read_inputs(items: list[str] | None) -> dict[str, tuple[np.ndarray, str]]:
    """Return {name: (array, file)} of --input NAME=FILE.npy values."""
    feeds = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep or not name:
            raise UsageError(f"--input expects NAME=FILE.npy, got {item!r}")
        with open(path, "rb") as f:  # an OSError names the file
            magic = f.read(6)
        if magic != _NPY_MAGIC and magic[:4] != _ZIP_MAGIC:  # numpy would guess a pickle and advise unpickling it
            raise UsageError(f"--input {item}: {path} is not a .npy file (it does not start with numpy's "
                             f"magic \\x93NUMPY); write it with numpy.save")
        try:
            v = np.load(path, allow_pickle=False)
        except OSError:
            raise  # names the file
        except ValueError as e:
            raise UsageError(f"--input {item}: not a .npy array ({' '.join(str(e).split())})") from e
        if not isinstance(v, np.ndarray):
            raise UsageError(f"--input {item}: expected one array in a .npy file, got a {type(v).__name__}")
        feeds[name] = (v, path)
    return feeds


def _cast_inputs(net, given: dict[str, tuple[np.ndarray, str]]) -> dict[str, np.ndarray]:
    """Return the given arrays in the model's input dtypes: a cast of the same kind or a widening
    one (float64 -> float32, int64 -> int32 when the values fit, bool -> float) comes with a note;
    anything else (float -> int) is an error."""
    want = {s.name: np.dtype(net.io_dtype(s).numpy) for s in net.inputs}  # (half under --fp16)
    out = {}
    for name, (v, path) in given.items():
        dt = want.get(name)
        if dt is None or v.dtype == dt:
            out[name] = v  # an unknown name is net.run's error to report
            continue
        if not np.can_cast(v.dtype, dt, "same_kind"):
            raise UsageError(f"input '{name}': {path} holds {v.dtype}, the model takes {dt}; convert the file")
        if dt.kind in "iu" and v.size and v.dtype.kind in "iu":
            info = np.iinfo(dt)
            if v.min() < info.min or v.max() > info.max:
                raise UsageError(f"input '{name}': {path} holds {v.dtype} values outside the range of {dt}, "
                               "which the model takes")
        note("input '%s': %s holds %s, the model takes %s: cast", name, path, v.dtype, dt)
        out[name] = v.astype(dt)
    return out


def _random_feeds(net, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Return random inputs for every input not given (batch dimension = `batch`)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for s in net.inputs:
        shape = tuple(batch if not isinstance(d, int) else d for d in s.shape)
        dt = np.dtype(net.io_dtype(s).numpy)
        if dt == np.bool_:
            feeds[s.name] = rng.random(shape) > 0.5
        elif dt.kind in "iu":
            feeds[s.name] = rng.integers(0, 4, shape).astype(dt)
        else:
            feeds[s.name] = rng.standard_normal(shape).astype(dt)
    return feeds


def _name(model) -> str:
    return os.path.basename(str(model))


def _is_artifact(a) -> bool:
    """True when the command's model is a built .lml artifact; raise UsageError for the options
    that were fixed when it was built."""
    from .artifact import is_artifact

    if not is_artifact(a.model):
        return False
    fixed = [flag for flag, given in (("--weights", a.weights), ("--input-shapes", a.input_shapes),
                                      ("--batch-axis", a.batch_axis != "auto")) if given]
    if fixed:
        raise UsageError(f"{a.model} is a built artifact: {', '.join(fixed)} was fixed when it was built "
                         "(`luisaml build` takes them)")
    return True


def _compile(a):
    import luisaml

    from .errors import CompileError

    fp16 = getattr(a, "fp16", False)
    if _is_artifact(a):
        if fp16:
            raise UsageError(f"{a.model} is a built artifact: its precision was fixed when it was built "
                             "(`luisaml build --fp16` takes it)")
        return luisaml.load(a.model, backend=None if a.backend == "auto" else a.backend)
    with phase("compile", model=_name(a.model), backend=a.backend):
        try:
            net = luisaml.compile(a.model, a.weights, backend=a.backend, batch_axis=_batch_axis(a.batch_axis),
                                  input_shapes=checked_input_shapes(a.model, a.weights, a.input_shapes),
                                  precision="fp16" if fp16 else "fp32", tune=getattr(a, "tune", None) or False)
        except CompileError as e:
            if fp16 and "needs the fused MLP kernel" in str(e):
                why = str(e).split("this graph is not one: ", 1)[-1]
                raise UsageError(f"--fp16 does not apply to {_name(a.model)}: half precision is luisaml's fused MLP "
                                 f"kernel's (a chain of Gemm/MatMul and activations), and this model is not one: "
                                 f"{why}") from None
            raise
    logger.info("generated module: %s", net.path)
    return net


# ---- commands --------------------------------------------------------------------------------
def cmd_run(a) -> int:
    """Compile (or load) a model, run it on the given or random inputs and print its outputs;
    with --compare, onnxruntime's too and the largest difference."""
    given = _read_inputs(a.input)
    net = _compile(a)
    feeds = _cast_inputs(net, given)
    missing = {k: v for k, v in _random_feeds(net, a.batch).items() if k not in feeds}
    if missing:
        note("random inputs for %s (batch %d, seed 0)", sorted(missing), a.batch)
    feeds.update(missing)
    with phase("run", backend=net.backend):
        out = net.run(feeds)
    np.set_printoptions(precision=6, suppress=True, threshold=64, edgeitems=4)
    ref = None
    if a.compare and net.artifact is not None:
        print("onnxruntime needs the ONNX model, not the built artifact: outputs not compared")
    elif a.compare:
        ref = onnxruntime_outputs(a.model, a.weights, feeds)
    failures = []  # (how far past the tolerance, message) of each output that fails it
    for name, v in out.items():
        print(f"{name}: {v.dtype}{list(v.shape)}")
        print(v)
        if ref is not None and name in ref:
            r = ref[name]
            print(f"onnxruntime {name}:")
            print(r)
            if r.shape != v.shape:
                msg = f"shapes differ: luisaml {list(v.shape)}, onnxruntime {list(r.shape)}"
                print(msg)
                failures.append((np.inf, f"output '{name}': {msg}"))
            else:
                worst = compare_outputs(v, r, a.atol, a.rtol)
                print(f"largest difference from onnxruntime: {worst.diff:.3g}")
                if worst.ratio > 1:
                    failures.append((worst.ratio, f"output '{name}' at index {list(worst.index)}: luisaml "
                                     f"{worst.got:.7g}, onnxruntime {worst.want:.7g}, difference {worst.diff:.3g} > "
                                     f"atol {a.atol:g} + rtol {a.rtol:g} x |onnxruntime| ({worst.bad} of {v.size} "
                                     f"elements past it)"))
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            np.save(os.path.join(a.out, f"{name.replace('/', '_')}.npy"), v)
    if failures:
        failures.sort(key=lambda f: -f[0])
        print(f"luisaml: error: outputs differ from onnxruntime past --atol {a.atol:g} --rtol {a.rtol:g}; worst: "
              f"{failures[0][1]}" + (f" ({len(failures)} outputs fail)" if len(failures) > 1 else ""), file=sys.stderr)
        return 3
    if ref is not None:
        print(f"all outputs within atol {a.atol:g}, rtol {a.rtol:g} of onnxruntime")
    return 0


def _target(p) -> None:
    p.add_argument("--target", default="cpu", choices=["cpu", "cuda"],
                   help="the backend whose plan to show, without a device (cuda: the fused MLP kernel and "
                        "cooperative blocks stages, as compile chooses them there)")


def cmd_inspect(a) -> int:
    """Print what a model compiles to, without a device: the report of luisaml/report.py as text,
    or as one JSON document (--json: its keys are documented in luisaml/report.py's docstring);
    --html FILE also writes it as one self-contained page; --profile runs the model once to add each
    stage's time. Exit 1 when nodes are unsupported."""
    from . import report

    if _is_artifact(a):
        return _inspect_artifact(a)
    shapes = checked_input_shapes(a.model, a.weights, a.input_shapes)
    rep = report.build(a.model, a.weights, batch_axis=_batch_axis(a.batch_axis), input_shapes=shapes,
                       name=_name(a.model), target=a.target)
    if (a.profile or a.tune) and not rep["unsupported"]:
        import luisaml

        with phase("compile", model=_name(a.model), backend=a.target):  # as report.build plans: direct convolutions
            net = luisaml.compile(a.model, a.weights, backend=a.target, batch_axis=_batch_axis(a.batch_axis),
                                  input_shapes=shapes, winograd=False, tune=a.tune or False)
        if a.tune:  # (the compiled plan's: its tuned schedules)
            rep = {**report.from_plan(net.plan, model_name=rep["model"]), **{k: rep[k] for k in (
                "opsets", "inputs", "outputs", "op_counts", "unsupported", "batch_symbol")}}
        rep = _profiled(rep, net) if a.profile else rep
    if a.html:
        page = report.html(rep)  # drawn before the file is opened: an error leaves no empty page
        with open(a.html, "w", encoding="utf-8") as f:
            f.write(page)
        note("wrote %s", a.html)
    print(report.to_json(rep) if a.json else report.text(rep))
    return 1 if rep["unsupported"] else 0


def _profiled(rep: dict, net) -> dict:
    """Return the report with each stage's time: the network run once on random inputs of its
    inputs' shapes (the model's batch, or 1), each stage then launched alone (net.profile)."""
    from . import report

    batch, _ = bench_batch(net, None)
    feeds = _random_feeds(net, batch)
    repeat = 5
    with phase("profile", backend=net.backend):
        net.run(feeds)  # builds the kernels, so that no stage's time is its build
        times = net.profile(feeds, repeat=repeat)
    return report.with_profile(rep, times, backend=net.backend, batch=batch, repeat=repeat)


def _inspect_artifact(a) -> int:
    """inspect for a built .lml: what the artifact records (its versions, backend, hash, members)
    and the report made when it was built; reads the file only (no device, no compile) unless
    --profile loads it to time its stages."""
    from . import artifact, report

    with phase("artifact read", path=a.model):
        art = artifact.read(a.model)
    rep = art.report
    m = art.manifest
    if a.profile and rep is not None:
        a.backend = "auto"
        rep = _profiled(rep, _compile(a))
    about = {"path": a.model, "format_version": m["format_version"], "backend": m["backend"],
             "built_with": m["built_with"], "created": m.get("created"), "content_hash": m["content_hash"],
             "members": {k: v["bytes"] for k, v in m["members"].items()}}
    if a.html:
        if rep is None:
            raise UsageError(f"{a.model} holds no inspect report (see the warning when it was built): no --html")
        page = report.html(rep)
        with open(a.html, "w", encoding="utf-8") as f:
            f.write(page)
        note("wrote %s", a.html)
    if a.json:
        print(report.to_json({**(rep or {}), "artifact": about}))
        return 0
    built = m["built_with"]
    print(f"artifact {a.model}: format {about['format_version']}, {m['backend']} backend, built {about['created']} "
          f"with luisaml {built.get('luisaml')}, luisa-python {built.get('luisa_python')}, Python {built.get('python')}")
    print(f"content hash {about['content_hash']}; " + ", ".join(f"{k} {mib(n)}" for k, n in about["members"].items()))
    print(report.text(rep) if rep is not None else "(no inspect report in the artifact)")
    return 0


def cmd_build(a) -> int:
    """Compile a model and write it as one .lml artifact (luisaml/artifact.py)."""
    if a.weights and a.weights_file:
        raise UsageError(f"weights given twice: {a.weights_file} and --weights {a.weights}")
    a.weights = a.weights or a.weights_file
    if _is_artifact(a):
        raise UsageError(f"{a.model} is already a built artifact; build takes an .onnx or .json model")
    if os.path.isdir(a.output):
        raise UsageError(f"--output {a.output} is a directory; give the .lml file to write, e.g. "
                         f"{os.path.join(a.output, os.path.splitext(_name(a.model))[0] + '.lml')}")
    t0 = time.perf_counter()
    net = _compile(a)
    path = net.save(a.output, model_name=_name(a.model))
    from .artifact import read

    art = read(path)  # what load will check, checked now
    print(f"wrote {path} ({mib(os.path.getsize(path))}, {net.backend} backend, content hash "
          f"{art.content_hash[:16]}) in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_emit(a) -> int:
    """Print the generated module of a model (or the one a built artifact holds)."""
    if _is_artifact(a):
        from .artifact import read

        sys.stdout.write(read(a.model).source)
        return 0
    from .runtime import analyze  # (imports onnx: not on the artifact's path)

    with phase("analyze", model=_name(a.model)):
        source = analyze(a.model, a.weights, batch_axis=_batch_axis(a.batch_axis),
                         input_shapes=checked_input_shapes(a.model, a.weights, a.input_shapes), target=a.target,
                         fuse="gpu" if a.target == "cuda" else "off").source
    sys.stdout.write(source)
    return 0


def cmd_bench(a) -> int:
    """Time compile + first run, then net.run on random inputs (after --warmup runs) for
    --iterations runs or --duration seconds: latency P50/P95/P99 and throughput; --profile adds
    each stage's time (a table, and a Chrome trace with --profile-json)."""
    t0 = time.perf_counter()
    net = _compile(a)
    batch, why = bench_batch(net, a.batch)
    feeds = _random_feeds(net, batch)
    with phase("first run"):
        net.run(feeds)  # builds the kernels
    print(f"compile + first run: {time.perf_counter() - t0:.2f} s on {net.backend}")
    for _ in range(a.warmup):
        net.run(feeds)
    times = []
    start = time.perf_counter()
    while len(times) < a.iterations or (a.duration is not None and time.perf_counter() - start < a.duration):
        t = time.perf_counter()
        net.run(feeds)
        times.append((time.perf_counter() - t) * 1e3)
    p50, p95, p99 = np.percentile(times, [50, 95, 99])
    mean = float(np.mean(times))
    print(f"batch {batch} ({why}); {a.warmup} warm-up runs, {len(times)} timed runs (host copies included)")
    print(f"latency: P50 {p50:.3f} ms  P95 {p95:.3f} ms  P99 {p99:.3f} ms  mean {mean:.3f} ms")
    print(f"throughput: {batch * 1e3 / mean:.1f} samples/s ({1e3 / mean:.1f} runs/s)")
    if a.profile or a.profile_json:
        stages = net.profile(feeds, repeat=max(1, min(a.iterations, 20)))
        total = sum(ms for _, ms in stages) or 1.0
        width = min(72, max(len("stage"), *(len(name) for name, _ in stages)))
        print(f"\n{'stage':{width}s}  {'median ms':>10s}  {'share':>6s}")
        for name, ms in stages:
            print(f"{name[:width]:{width}s}  {ms:10.3f}  {100 * ms / total:5.1f}%")
        print(f"{'all stages, each launched alone':{width}s}  {total:10.3f}")
        if a.profile_json:
            write_chrome_trace(a.profile_json, stages, process=f"luisaml {_name(a.model)} ({net.backend}, batch {batch})")
            note("wrote %s (open it in chrome://tracing or ui.perfetto.dev)", a.profile_json)
    return 0


def write_chrome_trace(path: str, stages: list[tuple[str, float]], process: str) -> None:
    """Write (name, milliseconds) spans, one after another, as a Chrome trace (the JSON array of
    complete events "ph": "X" that chrome://tracing, Perfetto and onnxruntime's profiler use)."""
    import json

    events, ts = [], 0.0
    for k, (name, ms) in enumerate(stages):
        events.append({"name": name, "cat": "stage", "ph": "X", "ts": round(ts, 3), "dur": round(ms * 1e3, 3),
                       "pid": 0, "tid": 0, "args": {"stage": k}})
        ts += ms * 1e3
    events.append({"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": process}})
    with open(path, "w", encoding="utf-8") as f:
        json.dump(events, f)


def cmd_cache_info(a) -> int:
    """Print every cache folder with its files and bytes, and the bounds on generated modules and kernels."""
    from . import cache

    folders = cache.info()
    width = max(len(f.what) for f in folders)
    for f in folders:
        print(f"{f.what:{width}s}  {f.files:6d} files  {mib(f.bytes):>10s}  {f.path}")
    bound = f"{cache.MAX_BYTES / 2**20:.0f} MiB" if cache.MAX_BYTES is not None else "invalid"
    print(f"bound on generated modules: {bound} (LUISAML_CACHE_MAX_MB), least recently used removed first")
    kbound = f"{cache.KERNEL_MAX_BYTES / 2**20:.0f} MiB" if cache.KERNEL_MAX_BYTES is not None else "invalid"
    print(f"bound on LuisaCompute's kernel files: {kbound} (LUISAML_KERNEL_CACHE_MAX_MB), applied before a process's "
          "first kernel build, least recently used removed first")
    print("LuisaCompute's kernels live beside the Python executable and are shared by every LuisaCompute "
          "program of that Python")
    return 0


def cmd_cache_clear(a) -> int:
    """Empty luisaml's caches (and LuisaCompute's kernel files unless --keep-kernels)."""
    from . import cache

    for f in cache.clear(kernels=not a.keep_kernels):
        print(f"{f.what}: removed {f.files} files ({mib(f.bytes)}) from {f.path}")
    return 0


def _parser() -> argparse.ArgumentParser:
    verbosity = _Parser(add_help=False)  # -v/-q after the command too (`luisaml run m.onnx -v`)
    verbosity.add_argument("-v", "--verbose", action="count", default=0, dest="sub_verbose",
                           help="log compile phases and times (-vv: debug)")
    verbosity.add_argument("-q", "--quiet", action="count", default=0, dest="sub_quiet",
                           help="only errors on stderr")
    ap = _Parser(prog="luisaml", description="Compile ONNX models into one LuisaCompute kernel.",
                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=(
                     "exit codes: 0 done, 2 bad input, 1 internal error (-v shows its traceback)\n"
                     "environment: LUISAML_BACKEND (auto, cpu, cuda), LUISAML_CACHE (the cache folder),\n"
                     "  LUISAML_CACHE_MAX_MB (its bound, default 512), LUISAML_KERNEL_CACHE_MAX_MB (the bound on\n"
                     "  LuisaCompute's kernel files, default 4096); `luisaml cache info` shows them"))
    ap.add_argument("--version", action="version", version=_version())
    ap.add_argument("-v", "--verbose", action="count", default=0, help="log compile phases and times (-vv: debug)")
    ap.add_argument("-q", "--quiet", action="count", default=0, help="only errors on stderr")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{build,run,inspect,emit,bench,cache}")
    p = sub.add_parser("build", parents=[verbosity],
                       help="compile a model into one .lml file that luisaml.load runs without onnx")
    _common(p)
    p.add_argument("weights_file", nargs="?", metavar="weights", help="the weights (as --weights)")
    p.add_argument("--output", "-o", required=True, metavar="FILE.lml", help="the artifact to write")
    _fp16(p)
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"],
                   help="the backend it runs on (an artifact runs on the backend it was built for)")
    p.set_defaults(fn=cmd_build)
    p = sub.add_parser("run", parents=[verbosity], help="compile and run a model, print its outputs")
    _common(p)
    p.add_argument("--input", "-i", action="append", metavar="NAME=FILE.npy",
                   help="an input (default: random); cast to the model's dtype where that loses no kind")
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--batch", type=cli_args.count(0), default=4, help="batch size of random inputs")
    p.add_argument("--out", help="folder to write each output as NAME.npy (a '/' in NAME written '_')")
    p.add_argument("--compare", action="store_true",
                   help="also run onnxruntime; exit 3 naming the worst output and index when an output is past "
                        "|luisaml - onnxruntime| <= atol + rtol x |onnxruntime|")
    p.add_argument("--atol", type=cli_args.tolerance, default=1e-5, help="absolute tolerance of --compare (default 1e-5)")
    p.add_argument("--rtol", type=cli_args.tolerance, default=1e-5, help="relative tolerance of --compare (default 1e-5)")
    _tune(p)
    _fp16(p)
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("inspect", parents=[verbosity],
                       help="per node: stage, output, parameters, FLOPs, bytes; the stages; both allocations")
    _common(p)
    p.add_argument("--json", action="store_true", help="print the report as one JSON document (stable keys)")
    p.add_argument("--html", metavar="FILE", help="also write the report as one self-contained HTML page: the "
                                                  "graph by stage (zoom, search, a node's attributes on click) and "
                                                  "the live ranges of both allocations")
    p.add_argument("--profile", action="store_true",
                   help="also compile and run the model once on random inputs (on the --target backend, or an "
                        "artifact's own) and time each stage launched alone: in the text, the JSON and the page")
    _tune(p)
    _target(p)
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("emit", parents=[verbosity], help="print the generated module")
    _common(p)
    _target(p)
    p.set_defaults(fn=cmd_emit)
    p = sub.add_parser("bench", parents=[verbosity],
                       help="time net.run on random inputs: latency P50/P95/P99, throughput, per-stage times")
    _common(p)
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--batch", type=cli_args.count(1), default=None,
                   help="samples per run for a model with a dynamic batch (default 1; refused with the largest "
                        "that fits when it would not fit in free memory); a static model runs its own batch")
    p.add_argument("--warmup", type=cli_args.count(0), default=3, help="untimed runs after the first (default 3)")
    p.add_argument("--iterations", "--repeat", type=cli_args.count(1), default=20, dest="iterations",
                   help="timed runs (default 20; the least with --duration)")
    p.add_argument("--duration", type=cli_args.seconds, default=None, metavar="SECONDS",
                   help="keep timing runs for at least this long")
    p.add_argument("--profile", action="store_true", help="also time each stage alone and print a table")
    p.add_argument("--profile-json", metavar="PATH", help="write the stages' times as a Chrome trace (implies --profile)")
    _tune(p)
    _fp16(p)
    p.set_defaults(fn=cmd_bench)
    p = sub.add_parser("cache", parents=[verbosity], help="show or clear luisaml's and LuisaCompute's caches")
    cs = p.add_subparsers(dest="cache_cmd", metavar="{info,clear}")
    p.set_defaults(fn=cmd_cache_info)
    c = cs.add_parser("info", parents=[verbosity], help="folders, files and bytes of each cache (the default)")
    c.set_defaults(fn=cmd_cache_info)
    c = cs.add_parser("clear", parents=[verbosity],
                      help="empty luisaml's caches and LuisaCompute's kernel files (rebuilt on next use)")
    c.add_argument("--keep-kernels", action="store_true", help="leave LuisaCompute's compiled kernels")
    c.set_defaults(fn=cmd_cache_clear)
    return ap


# ---- logging and errors ----------------------------------------------------------------------
class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        kind = ("error: " if record.levelno >= logging.ERROR else "warning: " if record.levelno >= logging.WARNING
                else "note: " if getattr(record, "note", False) else "")
        text = f"luisaml: {kind}{record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


@contextlib.contextmanager
def _logging(verbosity: int):
    """Send luisaml's records to stderr while a command runs: errors only (-q), warnings and notes
    (default), every phase (-v), debug (-vv)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    level = logging.ERROR if verbosity < 0 else logging.INFO if verbosity <= 1 else logging.DEBUG
    if verbosity == 0:
        handler.addFilter(lambda r: r.levelno >= logging.WARNING or getattr(r, "note", False))
    old = logger.level
    logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def _message(e: BaseException) -> str:
    """One line saying what went wrong, with the library's option names turned into flags."""
    if isinstance(e, OSError) and e.filename is not None and not isinstance(e, LuisamlError):
        text = f"{e.strerror or e}: '{e.filename}'"
    else:
        text = " ".join(str(e).split()) or type(e).__name__
    return (text.replace("input_shapes={name: [...]}", "--input-shapes NAME:DIMxDIM... (? keeps a dim dynamic)")
            .replace("batch_axis='auto'", "--batch-axis auto"))


def _detach_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's last flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _tune(p) -> None:
    p.add_argument("--tune", choices=["fast", "full"], help="search GEMM and Conv schedules on the device "
                   "(compile(tune=...): the tuning cache keeps the choices); inspect then compiles on --target")


def _fp16(p) -> None:
    p.add_argument("--fp16", action="store_true",
                   help="half-precision inputs, outputs and tensor-core math (precision='fp16'): models that compile "
                        "into the fused MLP kernel only; emulated on the CPU backend")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `luisaml` command; returns the exit code."""
    try:
        a = _parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or a bad argument (already said in one line)
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    verbosity = a.verbose + a.sub_verbose - a.quiet - a.sub_quiet
    with _logging(verbosity):
        try:
            rc = a.fn(a)
            sys.stdout.flush()
            return rc
        except BrokenPipeError:  # `luisaml emit m.onnx | head`: the reader has all it wanted
            _detach_stdout()
            return 141  # 128 + SIGPIPE, what a shell reports for a program cut off this way
        except KeyboardInterrupt:
            print("luisaml: interrupted", file=sys.stderr)
            return 130
        except Exception as e:
            missing = (e.name or "").split(".")[0] if isinstance(e, ModuleNotFoundError) else None
            if missing in OPTIONAL_PACKAGES:  # a runtime-only install (README: the .lml artifact)
                print(f"luisaml: error: this needs the Python package '{missing}', which is not installed (pip "
                      f"install {OPTIONAL_PACKAGES[missing]}); luisaml's runtime alone runs built .lml artifacts",
                      file=sys.stderr)
                return 2
            bad_input = isinstance(e, LuisamlError) or (isinstance(e, OSError) and e.filename is not None)
            hint = "" if bad_input or verbosity > 0 else " (run with -v for the traceback)"
            what = "" if bad_input else f"internal error: {type(e).__name__}: "
            print(f"luisaml: error: {what}{_message(e)}{hint}", file=sys.stderr)
            if verbosity > 0:
                traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
            return 2 if bad_input else 1


if __name__ == "__main__":
    sys.exit(main())
