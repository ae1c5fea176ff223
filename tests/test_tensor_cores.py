"""The tensor-core route on a machine without a GPU: the marked tiles' DSL bodies against numpy on the
CPU backend, the compiler front's rewrite of a source shaped like LuisaCompute's CUDA emission (nvcc
compiles it for sm_90 and cuobjdump shows HMMA, where the CUDA toolkit is), byte-identical pass
through of unmarked sources (the front run as LuisaCompute runs it, on a stand-in compiler), and the
runtime directory."""
from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from luisaml import nvrtc_front, tensor_cores
from luisaml.shaders import tensor_cores as tc


def _tool(name: str) -> str | None:
    """A CUDA toolkit program: on PATH, under /usr/local/cuda*/bin, or from the nvidia-cuda-* wheels."""
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/local/cuda*/bin/{name}"), reverse=True)), None)
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        hits = sorted(glob.glob(os.path.join(root, "*", "bin", name)))
        if hits:
            return hits[-1]
    return None


@pytest.fixture
def cpu_only():
    from luisaml import device

    if device.current() != "cpu":
        pytest.skip("the CPU backend's answer (tests/gpu/test_tensor_cores_cuda.py has CUDA's)")


# ---- the DSL bodies (what the CPU backend and the fallback run) ----------------------------------------


@pytest.mark.parametrize("kind", tensor_cores.KINDS)
def test_dsl_tile_is_the_fp32_product(kind):
    """One warp's tile through the contract's loads (warp_tile_*) against numpy in float64: the
    DSL body is the FP32 product, to FP32 rounding."""
    import luisa

    rng = np.random.default_rng(3)
    _, _, k = tc.SHAPES[kind]
    a = rng.standard_normal((16, k)).astype(np.float32)
    b = rng.standard_normal((k, 8)).astype(np.float32)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    bufs = [luisa.Buffer.from_array(x.ravel()) for x in (a, b, c)]
    d = luisa.Buffer(128, float)
    (tc.warp_tile_tf32 if kind == "tf32" else tc.warp_tile_f16)(*bufs, d, dispatch_size=32)
    luisa.synchronize()
    ref = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_allclose(d.numpy().reshape(16, 8), ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("kind", tensor_cores.KINDS)
def test_self_test_tells_the_fp32_body_from_the_mma(kind, cpu_only):
    """The self-test's operands: their rounded product and FP32 product differ by far more than the
    tolerance; on the CPU backend (the DSL body) the self-test reads 'not live, the FP32 product'."""
    _, _, _, rounded, fp32 = tensor_cores.test_operands(kind)
    assert 1e-4 < np.abs(rounded - fp32).max() < 1e-2
    t = tensor_cores.self_test(kind)
    assert not t.live and "FP32 product" in t.why, t
    assert t.err_fp32 < 1e-4 < t.err_rounded


def test_status_without_cuda_is_not_live(cpu_only):
    assert not tensor_cores.live("tf32")


# ---- the front's rewrite ----------------------------------------------------------------------------

# (custom_<hash>: 16 upper-case hex digits, hash_to_string's {:016X}.)
# What CUDACodegenAST (LuisaCompute src/backends/cuda/cuda_codegen_ast.cpp at the 0.3.7 snapshot) writes
# for warp_tile_tf32 and its callable: `__forceinline__ __device__ T custom_<hash>(` with one
# parameter a line (`_emit_variable_decl`: references `const T &r<uid>`, values `T v<uid>`),
# `) noexcept {`, the locals `T v<uid>{};`, the statements two spaces in, `}` alone at column 0. The
# types are small stand-ins of the device library's (cuda_device_math.h: lc_float4, lc_array).
_PRELUDE = r"""
using lc_float = float;
using lc_uint = unsigned int;
using lc_int = int;
struct alignas(16) lc_float4 {
    lc_float x, y, z, w;
    __device__ inline constexpr lc_float4() noexcept : x{}, y{}, z{}, w{} {}
    __device__ inline constexpr lc_float4(lc_float x, lc_float y, lc_float z, lc_float w) noexcept
        : x{x}, y{y}, z{z}, w{w} {}
};
__device__ inline lc_float4 operator*(lc_float4 a, lc_float s) noexcept { return lc_float4(a.x * s, a.y * s, a.z * s, a.w * s); }
__device__ inline lc_float4 lc_make_float4(lc_float x, lc_float y, lc_float z, lc_float w) noexcept { return lc_float4(x, y, z, w); }
template<typename T, unsigned long N>
class lc_array {
private:
    T _data[N];
public:
    template<typename... Elem>
    __device__ constexpr lc_array(Elem... elem) noexcept : _data{elem...} {}
    [[nodiscard]] __device__ T &operator[](unsigned long i) noexcept { return _data[i]; }
    [[nodiscard]] __device__ T operator[](unsigned long i) const noexcept { return _data[i]; }
};
template<typename T>
struct LCBuffer { T *__restrict__ ptr; size_t size_bytes; };
__device__ inline lc_float lc_fma(lc_float a, lc_float b, lc_float c) noexcept { return fmaf(a, b, c); }
"""


def _emission(kind: str, marker: str | None = None, hash_: str = "9F3A5C1E77D20B46") -> str:
    k = tc.SHAPES[kind][2]
    na, nb = tc.array_sizes(kind)
    marker = str(tc.MARK_TF32 if kind == "tf32" else tc.MARK_F16) if marker is None else marker
    rot = "v22" if kind == "tf32" else "(2 * v22)"
    return _PRELUDE + f"""
__forceinline__ __device__ lc_float4 custom_{hash_}(
    const lc_array<lc_float, {na}> &r0,
    const lc_array<lc_float, {nb}> &r1,
    lc_float4 v2) noexcept {{
  lc_float v3{{}};
  lc_float v4{{}};
  lc_float v5{{}};
  lc_float v6{{}};
  lc_int v7{{}};
  v3 = v2.x;
  v4 = v2.y;
  v5 = v2.z;
  v6 = v2.w;
  v7 = 0;
  for (; v7 < {k}; v7 += 1) {{
    v3 = lc_fma(r0[v7], r1[v7], v3);
    v4 = lc_fma(r0[v7], r1[{k} + v7], v4);
    v5 = lc_fma(r0[{k} + v7], r1[v7], v5);
    v6 = lc_fma(r0[{k} + v7], r1[{k} + v7], v6);
  }}
  return (lc_make_float4(v3, v4, v5, v6) * static_cast<lc_float>(({marker} >> 30)));
}}

struct alignas(16) Params {{
  alignas(16) const LCBuffer<const lc_float> b10{{}};
  alignas(16) const LCBuffer<const lc_float> b11{{}};
  alignas(16) const LCBuffer<const lc_float> b12{{}};
  alignas(16) const LCBuffer<lc_float> b13{{}};
}};

extern "C" __global__ void kernel_main(const Params params) {{
  const auto &b10 = params.b10;
  const auto &b11 = params.b11;
  const auto &b12 = params.b12;
  auto b13 = params.b13;
  lc_int v20{{}};
  lc_int v21{{}};
  lc_int v22{{}};
  lc_array<lc_float, {na}> v23{{}};
  lc_array<lc_float, {nb}> v24{{}};
  lc_int v25{{}};
  lc_int v26{{}};
  lc_float4 v27{{}};
  lc_float4 v28{{}};
  v20 = static_cast<lc_int>(blockIdx.x * blockDim.x + threadIdx.x) % 32;
  v21 = v20 / 4;
  v22 = v20 % 4;
  v25 = 0;
  for (; v25 < {k}; v25 += 1) {{
    v26 = (v25 + {rot}) % {k};
    v23[v25] = b10.ptr[v21 * {k} + v26];
    v23[{k} + v25] = b10.ptr[(v21 + 8) * {k} + v26];
    v24[v25] = b11.ptr[v26 * 8 + 2 * v22];
    v24[{k} + v25] = b11.ptr[v26 * 8 + 2 * v22 + 1];
    v24[{2 * k} + v25] = b11.ptr[v26 * 8 + v21];
  }}
  v27 = lc_make_float4(b12.ptr[v21 * 8 + 2 * v22], b12.ptr[v21 * 8 + 2 * v22 + 1], b12.ptr[(v21 + 8) * 8 + 2 * v22], b12.ptr[(v21 + 8) * 8 + 2 * v22 + 1]);
  v28 = custom_{hash_}(v23, v24, v27);
  b13.ptr[v21 * 8 + 2 * v22] = v28.x;
  b13.ptr[v21 * 8 + 2 * v22 + 1] = v28.y;
  b13.ptr[(v21 + 8) * 8 + 2 * v22] = v28.z;
  b13.ptr[(v21 + 8) * 8 + 2 * v22 + 1] = v28.w;
}}
"""


@pytest.mark.parametrize("kind", tensor_cores.KINDS)
def test_rewrite_replaces_only_the_marked_body(kind):
    src = _emission(kind)
    new, notes = nvrtc_front.rewrite(src, tensor_cores.rules())
    assert not notes
    assert "mma.sync.aligned" in new and str(tc.MARK_TF32 if kind == "tf32" else tc.MARK_F16) not in new
    # everything outside the callable's body is as it was
    head = src.index(") noexcept {") + len(") noexcept {")
    tail = src.index("\n}\n", head)
    assert new[:head] == src[:head] and new.endswith(src[tail:])
    # the body names the callable's own parameters
    assert re.search(r'"f"\(r0\[0\]\)', new) and re.search(r'"f"\(v2\.x\)', new)


def test_unmarked_source_is_unchanged():
    src = _emission("tf32", marker="1511506920")
    new, notes = nvrtc_front.rewrite(src, tensor_cores.rules())
    assert new == src and not notes


def test_wrong_signature_is_left_alone_with_a_note():
    src = _emission("tf32").replace("lc_float4 v2) noexcept", "lc_float4 v2,\n    LCPrintBuffer print_buffer) noexcept")
    new, notes = nvrtc_front.rewrite(src, tensor_cores.rules())
    assert new == src and len(notes) == 1 and "left as written" in notes[0]


def _sass(tmp_path: Path, source: str) -> str:
    nvcc, cuobjdump, nvdisasm = _tool("nvcc"), _tool("cuobjdump"), _tool("nvdisasm")
    if not nvcc or not cuobjdump or not nvdisasm:
        pytest.skip("nvcc, cuobjdump or nvdisasm (which cuobjdump runs) not found")
    cu, cubin = tmp_path / "k.cu", tmp_path / "k.cubin"
    cu.write_text(source)
    r = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-O3", "-std=c++17", "-o", str(cubin), str(cu)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    env = dict(os.environ, PATH=os.path.dirname(nvdisasm) + os.pathsep + os.environ.get("PATH", ""))
    r = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("kind,hmma", [("tf32", "HMMA.1688.F32.TF32"), ("f16", "HMMA.16816.F32")])
def test_rewritten_emission_compiles_to_hmma(tmp_path, kind, hmma):
    """The rewritten source compiles for sm_90 with one HMMA, and the loads the mma does not read are
    gone (the rest of the contract's arrays is dead); the source as written has no HMMA."""
    new, _ = nvrtc_front.rewrite(_emission(kind), tensor_cores.rules())
    sass = _sass(tmp_path, new)
    assert sass.count(hmma) == 1, sass[-4000:]
    loads, fragments = len(re.findall(r"\bLDG\.", sass)), 6 if kind == "tf32" else 12
    assert loads == 4 + fragments, f"{loads} global loads (4 of C, {fragments} of the fragments expected)\n{sass[-4000:]}"
    plain = _sass(tmp_path, _emission(kind))
    assert "HMMA" not in plain


# ---- the front as a program, and its runtime directory ----------------------------------------------

_STAND_IN = """#!{python}
# a stand-in for luisa_nvrtc: echoes the version, or the source it was given, and its options
import sys
if sys.argv[1:] == ["--version"]:
    print(120800)
    sys.exit(0)
data = sys.stdin.buffer.read()
hexed = all(c in b"0123456789abcdef" for c in data[:16])
w = 16 if hexed else 8
size = lambda b: int(b, 16) if hexed else int.from_bytes(b, "little")
rest = data[w + size(data[:w]):]
src = rest[w:w + size(rest[:w]) - 1]
sys.stdout.buffer.write(b"hex " if hexed else b"raw ")
sys.stdout.buffer.write(" ".join(sys.argv[1:]).encode() + b"\\n" + src)
"""


def _stand_in_dylibs(tmp_path: Path) -> Path:
    d = tmp_path / "dylibs"
    d.mkdir()
    for n in ("liblc-core.so", "liblc-backend-cuda.so", "lcapi.cpython-311-x86_64-linux-gnu.so"):
        (d / n).write_bytes(b"\x7fELF stand-in")
    (d / ".cache").mkdir()
    real = d / "luisa_nvrtc"
    real.write_text(_STAND_IN.replace("{python}", sys.executable))
    real.chmod(real.stat().st_mode | stat.S_IXUSR)
    return d


def _run_front(front: Path, source: bytes, options=("-arch=compute_90", "-std=c++17"), hex_size=True) -> bytes:
    data = nvrtc_front.frame(b"my_kernel.cu\0", hex_size) + nvrtc_front.frame(source + b"\0", hex_size)
    r = subprocess.run([str(front), *options], input=data, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("hex_size", [False, True], ids=["raw size (the 0.3.7 wheel)", "hex size (later)"])
def test_runtime_dir_front_passes_unmarked_bytes_through(tmp_path, hex_size):
    dylibs = _stand_in_dylibs(tmp_path)
    d = tensor_cores.make_runtime_dir(tmp_path / "tc", dylibs)
    assert tensor_cores.make_runtime_dir(tmp_path / "tc", dylibs) == d  # made once
    names = sorted(os.listdir(d))
    assert names == ["lcapi.cpython-311-x86_64-linux-gnu.so", "liblc-backend-cuda.so", "liblc-core.so", "luisa_nvrtc"]
    assert all(os.readlink(d / n) == str(dylibs / n) for n in names if n != "luisa_nvrtc")
    assert not (d / "luisa_nvrtc").is_symlink() and os.access(d / "luisa_nvrtc", os.X_OK)
    assert tensor_cores.check_front(d / "luisa_nvrtc") is None
    # every byte, odd ones included, reaches the real compiler as it was sent
    tag = b"hex " if hex_size else b"raw "
    src = _emission("tf32", marker="1511506920").encode() + bytes(range(1, 256))
    assert _run_front(d / "luisa_nvrtc", src, hex_size=hex_size) == tag + b"-arch=compute_90 -std=c++17\n" + src
    # a marked callable reaches it rewritten, in the protocol it came in
    out = _run_front(d / "luisa_nvrtc", _emission("f16").encode(), hex_size=hex_size)
    assert out.startswith(tag) and b"mma.sync.aligned.m16n8k16" in out and str(tc.MARK_F16).encode() not in out


def test_front_compiles_as_written_when_the_rewrite_fails(tmp_path):
    """A rewritten source the real compiler refuses is compiled again as written."""
    dylibs = _stand_in_dylibs(tmp_path)
    real = dylibs / "luisa_nvrtc"
    real.write_text(real.read_text().replace("data = sys.stdin.buffer.read()",
                                             "data = sys.stdin.buffer.read()\nif b'mma.sync' in data: sys.exit(3)"))
    d = tensor_cores.make_runtime_dir(tmp_path / "tc", dylibs)
    src = _emission("tf32").encode()
    data = nvrtc_front.frame(b"k.cu\0") + nvrtc_front.frame(src + b"\0")
    r = subprocess.run([str(d / "luisa_nvrtc"), "-arch=compute_90"], input=data, capture_output=True, timeout=120)
    assert r.returncode == 0 and r.stdout == b"hex -arch=compute_90\n" + src
    assert b"compiling it as written" in r.stderr


def test_a_new_front_text_is_a_new_directory(tmp_path, monkeypatch):
    dylibs = _stand_in_dylibs(tmp_path)
    d1 = tensor_cores.make_runtime_dir(tmp_path / "tc", dylibs)
    monkeypatch.setattr(tensor_cores, "BODY_TF32", tensor_cores.BODY_TF32 + "\n  // changed")
    d2 = tensor_cores.make_runtime_dir(tmp_path / "tc", dylibs)
    assert d1 != d2 and (d2 / "luisa_nvrtc").read_text() != (d1 / "luisa_nvrtc").read_text()


def test_context_at_the_runtime_directory_loads_luisas_backends(tmp_path):
    """lcapi.Context takes the directory of links as its runtime directory: it finds the backends
    there and starts one through the links (the CPU backend, in a process of its own: one device a
    process; the CUDA backend is the device run's)."""
    code = (
        "import sys\nfrom pathlib import Path\nfrom luisaml import tensor_cores\nfrom luisa import lcapi\n"
        "d = tensor_cores.make_runtime_dir(Path(sys.argv[1]), tensor_cores.luisa_dylibs())\n"
        "ctx = lcapi.Context(str(d))\nprint('BACKENDS', sorted(ctx.installed_backends()))\n"
        "device = ctx.create_device('cpu')\nprint('DEVICE', str(d))\n"
        # (leave without luisa's teardown: its CPU backend has segfaulted at a process's exit now and then,
        # once in this test on a loaded CI host, after every line below was printed; the exit is not
        # what this test is about)
        "sys.stdout.flush(); sys.stderr.flush()\nimport os\nos._exit(0)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "'cuda'" in r.stdout and "'cpu'" in r.stdout and "DEVICE " + str(tmp_path) in r.stdout, r.stdout
    assert "Runtime directory: " + str(tmp_path) in r.stdout + r.stderr


def test_runtime_dir_is_none_where_the_front_cannot_answer(tmp_path, monkeypatch, caplog):
    """A front that does not answer --version (no driver, a noexec folder) leaves CUDA to luisa's own
    directory, said once; the route then reads as not live."""
    from luisaml import cache

    monkeypatch.setattr(tensor_cores, "_dir", [])
    monkeypatch.setattr(cache, "root", lambda path=None: tmp_path)
    monkeypatch.setattr(tensor_cores, "check_front", lambda front, timeout_s=120: "exit code 127: no libcuda.so.1")
    with caplog.at_level("WARNING", logger="luisaml"):
        assert tensor_cores.runtime_dir() is None and tensor_cores.runtime_dir() is None
    assert sum("compiler front cannot run" in r.getMessage() for r in caplog.records) == 1
    assert (tmp_path / "tensor-cores").is_dir()


# ---- "w64r": operands rounded where they are copied (tf32_round) and an mma without cvt -----------------


def test_half_ulp_then_truncation_is_cvt_rna():
    """tf32_round's body adds half a TF32 ulp (0x1000) to a finite value's bits and leaves NaN and inf; the
    mma drops the low 13 bits: together cvt.rna.tf32's rounding (to nearest, ties away), against an
    exact model of it on float64."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(4096) * 10.0 ** rng.integers(-30, 30, 4096), [3.4028235e38, -1.0e-40]])
    ties = (rng.integers(0, 0x3FC00, 64, dtype=np.uint32) << 13 | 0x1000).view(np.float32)  # finite, half an ulp over
    x = np.concatenate([x.astype(np.float32), ties, -ties])
    bits = x.view(np.uint32)
    finite = np.isfinite(x)
    got = ((np.where(finite, bits + np.uint32(0x1000), bits)) & np.uint32(0xFFFFE000)).view(np.float32)
    m, e = np.frexp(np.abs(x.astype(np.float64)))  # |x| = m 2^e, m in [0.5, 1): TF32 keeps 11 bits of m
    scaled = m * 2.0 ** 11
    want = np.sign(x) * np.ldexp(np.floor(scaled + 0.5), e - 11)  # ties away from zero
    sub = np.abs(x) < np.finfo(np.float32).tiny  # (subnormals: the same bit rule, no exponent model)
    with np.errstate(over="ignore"):  # (the largest float rounds up to inf, as cvt.rna's does)
        np.testing.assert_array_equal(got[~sub], want[~sub].astype(np.float32))
    special = np.array([np.inf, -np.inf, np.nan], np.float32).view(np.uint32)
    special = np.append(special, np.uint32(0x7FFFFFFF))  # NVIDIA's canonical NaN: + 0x1000 would carry into the sign
    kept = np.where(np.isfinite(special.view(np.float32)), special + np.uint32(0x1000), special) & np.uint32(0xFFFFE000)
    assert np.isinf(kept[:2].view(np.float32)).all() and np.isnan(kept[2:].view(np.float32)).all()



def _loads_through(src: str, name: str, marker: int) -> tuple[str, int]:
    """src with a marked rounding callable `name` (LuisaCompute's shape: its body the marker's product) and
    the tile's fragment loads of A and B passed through it; and the count of loads so passed."""
    rnd = (f"__forceinline__ __device__ lc_float {name}(\n    lc_float v0) noexcept {{\n"
           f"  return (v0 * static_cast<lc_float>(({marker} >> 30)));\n}}\n\n")
    src = src.replace("struct alignas(16) Params", rnd + "struct alignas(16) Params")
    return re.subn(r"(v2[34]\[[^\]]+\]) = (b1[01]\.ptr\[[^;]+\]);", rf"\1 = {name}(\2);", src)


def _nvcc_ptx(tmp_path, source: str) -> str:
    """nvcc's PTX of a CUDA source for sm_90 (the test skips where nvcc is not found)."""
    nvcc = _tool("nvcc")
    if not nvcc:
        pytest.skip("nvcc not found")
    cu = tmp_path / "k.cu"
    cu.write_text(source)
    r = subprocess.run([nvcc, "-arch=sm_90", "-ptx", "-O3", "-std=c++17", "-o", str(tmp_path / "k.ptx"), str(cu)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return (tmp_path / "k.ptx").read_text()

def test_rounded_emission_rewrites_and_compiles_without_cvt(tmp_path):
    """A LuisaCompute-shaped emission of tf32_round and mma_tf32_m16n8k8_rounded: the front replaces both bodies;
    nvcc compiles the result to PTX with one mma.sync, tf32_round's guarded add and no cvt.rna (the
    conversion moved out of the mma)."""
    src = _emission("tf32", marker=str(tc.MARK_TF32R))
    src, _ = _loads_through(src, "custom_1D2C3B4A59687706", tc.MARK_ROUND)
    new, notes = nvrtc_front.rewrite(src, tensor_cores.rules())
    assert not notes and str(tc.MARK_TF32R) not in new and str(tc.MARK_ROUND) not in new
    ptx = _nvcc_ptx(tmp_path, new)
    assert ptx.count("mma.sync.aligned.m16n8k8") == 1 and "cvt.rna.tf32" not in ptx and "add.u32" in ptx


# ---- the FP16 tile's copies: f16_round, float(half(x)) in the DSL body, nothing on the route ---------------


def test_f16_round_emission_rewrites_to_the_operand_and_compiles_without_scalar_cvt(tmp_path):
    """A LuisaCompute-shaped f16 emission whose fragment loads go through f16_round (as operators/tiled_mma.py's
    FP16 copies do): the front replaces its body by the operand itself, so nvcc's PTX has the mma and its six
    cvt.rn.f16x2 packs and no scalar conversion (the mma's own packs round to half as float(half(x)) does)."""
    src = _emission("f16")
    src, count = _loads_through(src, "custom_2E3D4C5B6A798817", tc.MARK_F16ROUND)
    assert count == 5  # (the contract's five loads of A and B)
    new, notes = nvrtc_front.rewrite(src, tensor_cores.rules())
    assert not notes and str(tc.MARK_F16) not in new and str(tc.MARK_F16ROUND) not in new
    assert re.search(r"lc_float custom_2E3D4C5B6A798817\(\n    lc_float v0\) noexcept \{\n  return v0;\n\}", new)
    ptx = _nvcc_ptx(tmp_path, new)
    assert ptx.count("mma.sync.aligned.m16n8k16") == 1 and ptx.count("cvt.rn.f16x2.f32") == 6
    assert "cvt.rn.f16.f32" not in ptx


def test_f16_round_dsl_body_is_numpys_float16():
    """f16_round's DSL body (what the CPU backend and a kernel without the front run) on the CPU backend: numpy's
    float16 rounding (to nearest even; past 65504 inf; half's subnormals), element for element."""
    import luisa

    from luisaml.shaders.tensor_cores import f16_round

    @luisa.func
    def round_all(x, y):
        i = dispatch_id().x  # noqa: F821 (a DSL builtin)
        y.write(i, f16_round(x.read(i)))

    rng = np.random.default_rng(5)
    halves = rng.integers(0, 0x7BFF, 256, dtype=np.uint16).view(np.float16).astype(np.float32)
    ulps = np.spacing(halves.astype(np.float16)).astype(np.float32)
    x = np.concatenate([rng.standard_normal(512) * 10.0 ** rng.integers(-9, 6, 512), halves + ulps / 2,  # ties
                        halves + ulps / 3, [65504.0, 65520.0, 1.0e5, -1.0e6, 3.0e-8, 6.0e-8, 0.0]]).astype(np.float32)
    x = np.concatenate([x, -x])
    xb, yb = luisa.Buffer.from_array(x), luisa.Buffer(len(x), float)
    round_all(xb, yb, dispatch_size=len(x))
    luisa.synchronize()
    with np.errstate(over="ignore"):  # (past half's range: inf, as the kernel's)
        want = x.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(yb.numpy(), want)
