"""Tensor cores through our own compiler front (shared/DESIGN.md section 3): the CUDA runtime
directory whose `luisa_nvrtc` is luisaml's front (luisaml/nvrtc_front.py), the fixed inline-PTX
bodies the front puts in place of the marked tile callables (shaders/tensor_cores.py), and the
start-up self-test that decides whether the route is live.

luisa-python 0.3.7 offers no matrix instruction and no inline code, but LuisaCompute's CUDA backend
compiles every kernel by running `<runtime dir>/luisa_nvrtc` as a child process, and
`lcapi.Context(dir)` takes any directory as the runtime directory. The directory made here (under
luisaml's cache folder, named by a hash of the front's text and of luisa's libraries) holds links to
every file of luisa's `dylibs/` and, in place of `luisa_nvrtc`, a Python script (shebang: this
interpreter, isolated) made of nvrtc_front.py's text, the real compiler's path and the rules below.
It is never a compiled binary, and nothing in it comes from a model.

- Every kernel without a marker compiles byte-identically (the front execs the real compiler on the
  same bytes); only marked callables change.
- LuisaCompute's kernel cache lives in the runtime directory (`.cache`, DefaultBinaryIO) and keys on
  the source *before* the rewrite: this directory has its own, and a new front text is a new
  directory, so a cached kernel never holds another front's bodies.
- device.init(tensor_cores=True) (compile with tensor_cores not False) starts the CUDA device here when
  the directory can be made and the front answers
  `--version`; else in luisa's own directory (logged once). The CPU backend never uses it: it runs
  the DSL bodies, the FP32 equivalent.
- `live(kind)` runs the self-test once per process: one warp's tile on values whose TF32 (FP16)
  rounding is exact and whose FP32 product is not, against numpy. The route is live only where the
  answer is the rounded product: the FP32 body (no rewrite, or a rewrite that did not compile and
  was compiled as written) answers the unrounded one and the route reads as not live (logged once),
  so compile(tensor_cores="auto") keeps the FP32 tiles.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from .log import logger

# ---- the bodies the front writes (CUDA C++ with inline PTX), the rules that place them -------------
# @A@, @B@, @C@: the callable's parameters a, b, c (the contract of shaders/tensor_cores.py). A lane's
# mma fragments sit at fixed indices of a and b; cvt.rna rounds FP32 to TF32 (to nearest, ties away),
# cvt.rn.f16x2.f32 packs two halves, the first operand in the upper 16 bits (the fragment's second).

BODY_TF32 = r"""
  unsigned int lc_tc_a0, lc_tc_a1, lc_tc_a2, lc_tc_a3, lc_tc_b0, lc_tc_b1;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lc_tc_a0) : "f"(@A@[0]));
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lc_tc_a1) : "f"(@A@[8]));
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lc_tc_a2) : "f"(@A@[4]));
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lc_tc_a3) : "f"(@A@[12]));
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lc_tc_b0) : "f"(@B@[16]));
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lc_tc_b1) : "f"(@B@[20]));
  lc_float4 lc_tc_d;
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};"
               : "=f"(lc_tc_d.x), "=f"(lc_tc_d.y), "=f"(lc_tc_d.z), "=f"(lc_tc_d.w)
               : "r"(lc_tc_a0), "r"(lc_tc_a1), "r"(lc_tc_a2), "r"(lc_tc_a3), "r"(lc_tc_b0), "r"(lc_tc_b1),
                 "f"(@C@.x), "f"(@C@.y), "f"(@C@.z), "f"(@C@.w));
  return lc_tc_d;"""

BODY_F16 = r"""
  unsigned int lc_tc_a0, lc_tc_a1, lc_tc_a2, lc_tc_a3, lc_tc_b0, lc_tc_b1;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(lc_tc_a0) : "f"(@A@[1]), "f"(@A@[0]));
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(lc_tc_a1) : "f"(@A@[17]), "f"(@A@[16]));
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(lc_tc_a2) : "f"(@A@[9]), "f"(@A@[8]));
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(lc_tc_a3) : "f"(@A@[25]), "f"(@A@[24]));
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(lc_tc_b0) : "f"(@B@[33]), "f"(@B@[32]));
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(lc_tc_b1) : "f"(@B@[41]), "f"(@B@[40]));
  lc_float4 lc_tc_d;
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};"
               : "=f"(lc_tc_d.x), "=f"(lc_tc_d.y), "=f"(lc_tc_d.z), "=f"(lc_tc_d.w)
               : "r"(lc_tc_a0), "r"(lc_tc_a1), "r"(lc_tc_a2), "r"(lc_tc_a3), "r"(lc_tc_b0), "r"(lc_tc_b1),
                 "f"(@C@.x), "f"(@C@.y), "f"(@C@.z), "f"(@C@.w));
  return lc_tc_d;"""

# mma_tf32_m16n8k8_rounded: the operands were rounded where they were copied (tf32_round), so their bits go to
# mma.sync as they are (mov.b32: a register's type, no instruction)
BODY_TF32R = BODY_TF32.replace('asm("cvt.rna.tf32.f32 %0, %1;"', 'asm("mov.b32 %0, %1;"')

# tf32_round: half a TF32 ulp added to a finite value's bits (NaN and inf as they are); the mma drops the
# low 13 bits, so the operand it multiplies is cvt.rna's (to nearest, ties away), as CUTLASS's
# round_half_ulp_truncate. Two instructions (cvt.rna to a float is four: it must clear the low bits too).
BODY_ROUND = r"""
  unsigned int lc_tc_r;
  lc_float lc_tc_x;
  asm("mov.b32 %0, %1;" : "=r"(lc_tc_r) : "f"(@X@));
  asm("{\n .reg .f32 lc_tc_a;\n .reg .pred lc_tc_p;\n abs.f32 lc_tc_a, %1;\n"
      " setp.geu.f32 lc_tc_p, lc_tc_a, 0f7F800000;\n @!lc_tc_p add.u32 %0, %0, 4096;\n}"
      : "+r"(lc_tc_r) : "f"(@X@));
  asm("mov.b32 %0, %1;" : "=f"(lc_tc_x) : "r"(lc_tc_r));
  return lc_tc_x;"""

# f16_round: the operand goes to the mma as it is; mma_f16_m16n8k16's cvt.rn.f16x2 rounds it to half (to nearest
# even) as the DSL body's float(half(x)) does (the FP16 tile rounds what it copies only for that body's sake)
BODY_F16ROUND = r"""
  return @X@;"""

KINDS = ("tf32", "f16")


def rules() -> list[dict]:
    """Return the front's rules: per marked callable its marker, signature and body."""
    from .shaders import tensor_cores as tc

    out = []
    for kind, marker, body in (("tf32", tc.MARK_TF32, BODY_TF32), ("f16", tc.MARK_F16, BODY_F16)):
        na, nb = tc.array_sizes(kind)
        out.append({"kind": kind, "marker": str(marker), "returns": "lc_float4",
                    "params": [f"lc_array<lc_float, {na}>", f"lc_array<lc_float, {nb}>", "lc_float4"],
                    "names": ["@A@", "@B@", "@C@"], "body": body})
    na, nb = tc.array_sizes("tf32")
    out.append({"kind": "tf32r", "marker": str(tc.MARK_TF32R), "returns": "lc_float4",
                "params": [f"lc_array<lc_float, {na}>", f"lc_array<lc_float, {nb}>", "lc_float4"],
                "names": ["@A@", "@B@", "@C@"], "body": BODY_TF32R})
    out.append({"kind": "round", "marker": str(tc.MARK_ROUND), "returns": "lc_float", "params": ["lc_float"],
                "names": ["@X@"], "body": BODY_ROUND})
    out.append({"kind": "f16round", "marker": str(tc.MARK_F16ROUND), "returns": "lc_float", "params": ["lc_float"],
                "names": ["@X@"], "body": BODY_F16ROUND})
    return out


def front_text(real: str, python: str = sys.executable) -> str:
    """Return the text of the runtime directory's `luisa_nvrtc`: nvrtc_front.py's code run by
    `python` (isolated: -I; no site: -S) on the real compiler `real` with rules()."""
    code = Path(__file__).with_name("nvrtc_front.py").read_text()
    return (f"#!{python} -IS\n"
            "# luisaml's luisa_nvrtc front, written by luisaml/tensor_cores.py: the text of luisaml/nvrtc_front.py\n"
            "# with the real compiler and the rules (data) at the end. Do not edit: a new text is a new directory.\n"
            + code
            + f"\n\nREAL_NVRTC = {real!r}\nRULES = {rules()!r}\n"
            + "sys.exit(main(sys.argv, REAL_NVRTC, RULES))\n")


def luisa_dylibs() -> Path:
    """Return luisa-python's runtime directory (its dylibs/, beside lcapi)."""
    import importlib.util

    spec = importlib.util.find_spec("luisa")
    if spec is None or not spec.origin:
        raise FileNotFoundError("luisa-python is not installed")
    return Path(os.path.realpath(spec.origin)).parent / "dylibs"


# ---- the runtime directory --------------------------------------------------------------------------

_lock = threading.Lock()
_dir: list = []  # [Path or None] once decided
_started_in: list = []  # [Path or None]: the runtime directory the CUDA device started in
_tests: dict[str, SelfTest] = {}
_said: set[str] = set()


def make_runtime_dir(root: Path, dylibs: Path, python: str = sys.executable) -> Path:
    """Return the runtime directory under `root` of links to `dylibs`' files with the front as
    `luisa_nvrtc` (made once, atomically: built beside and renamed into place)."""
    real = dylibs / "luisa_nvrtc"
    if not real.is_file():
        raise FileNotFoundError(f"{real} is missing")
    names = sorted(n for n in os.listdir(dylibs) if not n.startswith(".") and n != "luisa_nvrtc"
                   and not (dylibs / n).is_dir())
    text = front_text(str(real), python)
    key = hashlib.sha256("\0".join([text, str(dylibs)] + names).encode()).hexdigest()[:16]
    final = root / f"cuda-{key}"
    if (final / "luisa_nvrtc").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".making-", dir=root))
    try:
        for n in names:
            os.symlink(dylibs / n, tmp / n)
        front = tmp / "luisa_nvrtc"
        front.write_text(text)
        front.chmod(0o755)
        try:
            os.rename(tmp, final)
        except OSError:  # (another process made it first: theirs is the same)
            if not (final / "luisa_nvrtc").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def check_front(front: Path, timeout_s: float = 120) -> str | None:
    """Return None when `front --version` answers as the real compiler does (a version number),
    else why not."""
    try:
        r = subprocess.run([str(front), "--version"], capture_output=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
    if r.returncode != 0 or not r.stdout.strip().isdigit():
        return f"exit code {r.returncode}: {(r.stdout + r.stderr).decode(errors='replace').strip()[:300]}"
    return None


def runtime_dir() -> Path | None:
    """Return the tensor-core runtime directory of this process (made and checked once), or None
    where it cannot be made or its front does not answer (said once)."""
    with _lock:
        if not _dir:
            from . import cache

            try:
                d = make_runtime_dir(cache.root() / "tensor-cores", luisa_dylibs())
                why = check_front(d / "luisa_nvrtc")
            except Exception as e:  # (an unwritable cache, a missing file: CUDA starts as luisa.init does)
                d, why = None, f"{type(e).__name__}: {e}"
            if why is not None:
                logger.warning("tensor cores: the compiler front cannot run (%s); the CUDA device starts in "
                               "luisa's own runtime directory and matrix tiles keep their FP32 bodies", why)
                d = None
            _dir.append(d)
        return _dir[0]


def start_cuda_device(support_gui: bool = False) -> Path | None:
    """Start luisa's CUDA device in the tensor-core runtime directory (luisa.init's steps, with the
    context at that directory); return the directory, or None after starting it as luisa.init does
    where the directory is not available."""
    import luisa
    from luisa import globalvars, lcapi

    d = runtime_dir() if globalvars.vars is None else None  # (a device already started stays as it is)
    if d is None:
        luisa.init("cuda", support_gui=support_gui)
    else:
        globalvars.vars = globalvars.Vars()
        globalvars.vars.context = lcapi.Context(str(d))
        if "cuda" not in globalvars.vars.context.installed_backends():
            raise NameError("backend 'cuda' is not installed.")
        globalvars.device = globalvars.vars.context.create_device("cuda")
        globalvars.vars.stream = globalvars.device.create_stream(support_gui)
        globalvars.vars.stream_support_gui = support_gui
    _started_in[:] = [d]
    return d


def in_front() -> bool:
    """Whether this process's CUDA device started in the runtime directory of the compiler front (a
    kernel-build worker must start its own there too: luisaml/parallel_build.py)."""
    return bool(_started_in) and _started_in[0] is not None


# ---- the self-test ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SelfTest:
    """One warp's tile on the device: live where the answer is the TF32 (FP16) rounded product."""

    kind: str
    live: bool
    why: str  # what decided it
    err_rounded: float = float("nan")  # largest |answer - product of rounded inputs|
    err_fp32: float = float("nan")  # largest |answer - product of the inputs as given|


def test_operands(kind: str, seed: int = 0):
    """Return (A, B, C, rounded product, FP32 product) for the self-test: A and B integers of 1 to 8
    in magnitude plus less than half a TF32 (FP16) ulp, so the rounded inputs are the integers and
    the rounded product is exact, while the FP32 product differs by about 1e-3."""
    import numpy as np

    from .shaders import tensor_cores as tc

    rng = np.random.default_rng(seed)
    _, _, k = tc.SHAPES[kind]

    def draw(shape):
        whole = rng.integers(1, 9, size=shape) * rng.choice([-1, 1], size=shape)
        return whole.astype(np.float64), (whole + rng.uniform(0.1, 0.4, size=shape) * 2.0 ** -12).astype(np.float32)

    a_whole, a = draw((16, k))
    b_whole, b = draw((k, 8))
    c = rng.integers(-8, 9, size=(16, 8)).astype(np.float32)
    return a, b, c, a_whole @ b_whole + c, a.astype(np.float64) @ b.astype(np.float64) + c


def self_test(kind: str = "tf32") -> SelfTest:
    """Run one warp's tile of `kind` on the running device and say whether the tensor-core body ran."""
    import luisa
    import numpy as np

    from .shaders import tensor_cores as tc

    a, b, c, rounded, fp32 = test_operands(kind)
    bufs = [luisa.Buffer.from_array(np.ascontiguousarray(x).ravel()) for x in (a, b, c)]
    d = luisa.Buffer(128, float)
    kernel = tc.warp_tile_tf32 if kind == "tf32" else tc.warp_tile_f16
    kernel(*bufs, d, dispatch_size=32)
    luisa.synchronize()
    got = d.numpy().reshape(16, 8).astype(np.float64)
    e_r, e_f = float(np.abs(got - rounded).max()), float(np.abs(got - fp32).max())
    if e_r <= 1e-5:
        return SelfTest(kind, True, "the tile's answer is the rounded product: the mma body ran", e_r, e_f)
    if e_f <= 1e-3:
        return SelfTest(kind, False, "the tile's answer is the FP32 product: the DSL body ran (no rewrite, or the "
                        "rewrite did not compile)", e_r, e_f)
    return SelfTest(kind, False, "the tile's answer is neither product: the mma body is wrong here", e_r, e_f)


def _compute_capability() -> tuple[int, int]:
    """Return CUDA device 0's compute capability, (0, 0) where the driver cannot say."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        dev, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
        if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(dev), 0):
            return (0, 0)
        cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
        cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
        return (major.value, minor.value)
    except OSError:
        return (0, 0)


def status(kind: str = "tf32") -> SelfTest:
    """Return whether the route of `kind` is live in this process (the self-test, run once)."""
    with _lock:
        if kind in _tests:
            return _tests[kind]
    if not _started_in:
        t = SelfTest(kind, False, "no CUDA device was started here (the CPU backend runs the FP32 bodies)")
    elif _started_in[0] is None:
        t = SelfTest(kind, False, "the CUDA device did not start in the tensor-core runtime directory")
    elif _compute_capability() < (8, 0):
        t = SelfTest(kind, False, f"compute capability {_compute_capability()} is below 8.0 (mma.sync {kind})")
    else:
        try:
            t = self_test(kind)
        except Exception as e:  # (a failed build or launch: the route is off, the process goes on)
            t = SelfTest(kind, False, f"the self-test failed: {type(e).__name__}: {e}")
    with _lock:
        _tests.setdefault(kind, t)
        if not t.live and kind not in _said:
            _said.add(kind)
            logger.warning("tensor cores (%s) are not used: %s", kind, t.why)
        elif t.live:
            logger.info("tensor cores (%s): live (%s)", kind, t.why)
        return _tests[kind]


def live(kind: str = "tf32") -> bool:
    """Whether marked tiles of `kind` run on tensor cores in this process."""
    return status(kind).live
