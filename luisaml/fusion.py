"""Fusion: recognise a chain of dense layers (Gemm, or MatMul + Add, each with an optional
activation) from the batched graph input to the batched graph output, and describe the fast
cooperative batch kernel that runs it: a block of threads shares a tile of samples, activations
stay in shared memory, weights are staged in shared memory, and every thread accumulates a
register tile of samples x outputs with float4 loads.

The plan is chosen per shape (`plan_mlp`), recorded for `inspect` (`FusedMLP.describe`), and
emitted by shaders/mlp.py.j2. On the CPU backend the same arithmetic runs in an "emulated" form
(one CPU thread per block, a loop over the block's threads between barriers): luisa-python
0.3.7's CPU backend cannot compile shared memory or sync_block."""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field

import numpy as np

from . import dtypes
from .operator import CompileError
from .storage import Tensor

# Activations the fused kernel applies after a layer: ONNX op type -> DSL expression template.
ACTIVATIONS = {"Relu": "relu", "Sigmoid": "sigmoid", "Tanh": "tanh", "LeakyRelu": "leaky_relu"}
PRECISIONS = ("fp32", "fp16")
# Static __shared__ arrays (how LuisaCompute declares shared memory) are limited to 48 KiB a block.
SHARED_LIMIT = 48 * 1024
MAX_ACC = 64  # accumulators a thread holds: 64 floats keep a thread under ~128 registers
BLOB_ALIGN = 16
# kernel parameter: int buffer [next tile, blocks done], zero between launches (the last block
# resets it); the runtime owns one per compiled network (`tile_counter`)
TILE_COUNTER = "tile_counter"


@dataclass
class Layer:
    """One dense layer y = act(x W + b) with W as [K, N] (float32, alpha and transposes folded)."""

    weight: np.ndarray
    bias: np.ndarray
    act: str  # "none" or an ACTIVATIONS value
    alpha: float = 0.01  # LeakyRelu slope
    nodes: list[str] = field(default_factory=list)
    # chosen per shape by plan_mlp
    S: int = 0  # samples per thread
    O: int = 0  # outputs per thread
    Kc: int = 0  # rows of W staged in shared memory at a time (== Kp when resident)
    G: int = 1  # thread groups that split K (a narrow output layer), adding partial sums at the end
    w_off: int = 0  # byte offset of the packed [Kp][Np] weights in the blob (then the bias)
    wsh_off: int = 0  # float4 offset in the shared weight array (resident weights)

    @property
    def K(self) -> int:
        return self.weight.shape[0]

    @property
    def N(self) -> int:
        return self.weight.shape[1]

    @property
    def Np(self) -> int:
        """Outputs padded to a multiple of 4 (float4 loads and stores)."""
        return -(-self.N // 4) * 4

    @property
    def Np4(self) -> int:
        return self.Np // 4

    def packed(self, Kp: int) -> np.ndarray:
        """Return the blob record: W as [Kp][Np] (zero padded) followed by the bias [Np]."""
        w = np.zeros((Kp, self.Np), np.float32)
        w[: self.K, : self.N] = self.weight
        b = np.zeros(self.Np, np.float32)
        b[: self.N] = self.bias
        return np.concatenate([w.reshape(-1), b])


@dataclass
class FusedMLP:
    """A recognised MLP and the kernel plan chosen for it."""

    input: str
    output: str
    layers: list[Layer]
    K0: int
    precision: str = "fp32"
    mode: str = "gpu"  # "gpu": shared memory + barriers; "emulated": one CPU thread per block
    T: int = 128  # samples per tile (one block works on one tile at a time)
    NT: int = 128  # threads per block
    U: int = 4  # k-steps unrolled on the host inside the accumulation loop
    weights: str = "resident"  # "resident": all layers in shared memory for the whole kernel;
    # "staged": Kc rows at a time; "global": read from the blob (through L1) in the inner loop;
    # "pipelined": Kc rows at a time through two buffers, fetched into registers a chunk ahead
    blocks_per_sm: int = 4
    prefetch: bool = False  # load the next tile's inputs into registers during the output layer
    vector_acc: bool = False  # float4 accumulators (4x fewer DSL lines) instead of scalar ones
    sample_major: bool = True  # thread map: consecutive threads take consecutive sample groups
    kpipe: bool = False  # load the next k step's operands before this step's multiply-adds

    vec_bytes = 16  # activations and weights are float4s in shared memory (also in fp16 mode)

    @property
    def Tp4(self) -> int:
        """float4 stride of one activation row: T samples plus one float4 of padding (no bank
        conflicts when a warp writes a column)."""
        return self.T // 4 + 1

    def active(self, i: int) -> int:
        """Threads that own a register tile of layer i (per split-K group)."""
        l = self.layers[i]
        return (self.T // l.S) * (l.Np // l.O)

    @property
    def resident(self) -> bool:
        return self.weights == "resident"

    @property
    def act_rows(self) -> int:
        """Rows of the shared activation tile: the widest layer input."""
        return max(max(self.padded_k(i) for i in range(len(self.layers))), 1)

    def padded_k(self, i: int) -> int:
        return self.K0 if i == 0 else self.layers[i - 1].Np

    @property
    def act_float4(self) -> int:
        return self.act_rows * self.Tp4

    @property
    def chunk_regs(self) -> int:
        """float4 registers a thread holds the next weight chunk in (pipelined weights)."""
        return max(-(-l.Kc * l.Np4 // self.NT) for l in self.layers)

    @property
    def chunk_float4(self) -> int:
        """float4 elements of one of the two chunk buffers (pipelined weights)."""
        return self.chunk_regs * self.NT

    @property
    def wsh_float4(self) -> int:
        """float4 elements of the shared weight array."""
        if self.mode != "gpu" or self.weights == "global":
            return 0
        if self.resident:
            return sum(self.padded_k(i) * l.Np4 + l.Np4 for i, l in enumerate(self.layers))
        if self.weights == "pipelined":
            return 2 * self.chunk_float4
        return max(l.Kc * l.Np4 for l in self.layers)

    @property
    def shared_bytes(self) -> int:
        return self.vec_bytes * (self.act_float4 + self.wsh_float4) if self.mode == "gpu" else 0

    @property
    def flops_per_sample(self) -> int:
        return sum(2 * l.K * l.N for l in self.layers)

    def describe(self) -> str:
        """One line for inspect: what the fused kernel does for this shape."""
        dims = "-".join([str(self.K0)] + [str(l.N) for l in self.layers])
        acts = ",".join(l.act for l in self.layers)
        tiles = " ".join(
            f"{l.S}x{l.O}" + (f"/k{l.Kc}" if self.weights in ("staged", "pipelined") else "") + (f" split-K {l.G}" if l.G > 1 else "")
            for l in self.layers
        )
        where = (
            f"{self.weights} weights, {self.shared_bytes} B shared, up to {self.blocks_per_sm} blocks per SM taking tiles from an atomic counter"
            if self.mode == "gpu"
            else "emulated blocks (CPU backend: no shared memory), weights read from the blob"
        )
        return (
            f"fused MLP {dims} ({acts}), {self.precision}: tile of {self.T} samples per block of "
            f"{self.NT} threads, register tiles (samples x outputs) {tiles}, k unrolled by {self.U}, {where}"
            + (", next tile's inputs prefetched" if self.prefetch else "")
            + (", operands loaded a k step ahead" if self.kpipe else "")
        )

    def dispatch_size(self, n: int) -> int:
        """Threads to dispatch for a batch of n: whole blocks, one persistent block per slot an SM
        may hold."""
        tiles = -(-n // self.T)
        if self.mode == "gpu":
            blocks = min(tiles, sm_count() * self.blocks_per_sm)
            return max(blocks, 1) * self.NT
        return max(min(tiles, 4 * (os.cpu_count() or 1)), 1)


# ---- recognition ------------------------------------------------------------------------------


class NotFusable(Exception):
    """Why a graph is not a fusable MLP (said by inspect and by precision='fp16')."""


def _const(t: Tensor | None, what: str) -> np.ndarray:
    if t is None or t.value is None:
        raise NotFusable(f"{what} is not a constant")
    return np.asarray(t.value)


def _bias_row(value: np.ndarray, n: int, what: str) -> np.ndarray:
    """Return a constant broadcast to one row of n (per-sample shapes (n,), (1, n), scalars)."""
    v = np.asarray(value, np.float64)
    try:
        return np.broadcast_to(v, (1, n)).reshape(n).astype(np.float64)
    except ValueError:
        raise NotFusable(f"{what} of shape {list(v.shape)} does not broadcast to [1, {n}]") from None


def find_mlp(plan) -> FusedMLP:
    """Return the MLP a plan's graph is, or raise NotFusable saying why not."""
    if plan.symbol is None:
        raise NotFusable("no batch axis (the fused kernel runs one sample per tile row)")
    if len(plan.inputs) != 1 or len(plan.outputs) != 1 or plan.host_outputs:
        raise NotFusable("needs exactly one graph input and one graph output")
    xin, yout = plan.inputs[0], plan.outputs[0]
    for s, role in ((xin, "input"), (yout, "output")):
        if not s.batched or len(s.kernel_shape) != 2 or s.dtype is not dtypes.FLOAT:
            raise NotFusable(f"{role} '{s.name}' must be float32 [batch, features]")
    consumers: dict[str, list] = {}
    for node, op in plan.ops:
        for i in node.inputs:
            if i:
                consumers.setdefault(i, []).append((node, op))
    layers: list[Layer] = []
    cur = xin.name

    def only_consumer(name: str):
        users = consumers.get(name, [])
        if len(users) != 1:
            raise NotFusable(f"tensor '{name}' has {len(users)} consumers (a chain needs one)")
        return users[0]

    while cur != yout.name:
        node, op = only_consumer(cur)
        if node.op_type == "Gemm":
            if node.inputs[0] != cur or op.ta:
                raise NotFusable(f"{node.describe()}: the chain must be input A, not transposed")
            b = _const(op.input(1), f"{node.describe()}: B")
            w = (b.T if op.tb else b).astype(np.float64) * op.alpha
            bias = np.zeros(w.shape[1])
            if op.has_input(2) and op.beta != 0:
                bias = _bias_row(_const(op.input(2), f"{node.describe()}: C"), w.shape[1], f"{node.describe()}: C") * op.beta
            layers.append(Layer(w.astype(np.float32), bias.astype(np.float32), "none", nodes=[node.name]))
            cur = node.outputs[0]
        elif node.op_type == "MatMul":
            if node.inputs[0] != cur or op.input(1).rank != 2 or op.input(0).rank != 2:
                raise NotFusable(f"{node.describe()}: needs [batch, K] x constant [K, N]")
            w = _const(op.input(1), f"{node.describe()}: B").astype(np.float32)
            layer = Layer(w, np.zeros(w.shape[1], np.float32), "none", nodes=[node.name])
            cur = node.outputs[0]
            if cur != yout.name:
                nxt, nop = only_consumer(cur)
                if nxt.op_type == "Add":
                    other = nop.inputs[1] if nxt.inputs[0] == cur else nop.inputs[0]
                    layer.bias = _bias_row(_const(other, f"{nxt.describe()}: bias"), w.shape[1], f"{nxt.describe()}: bias").astype(np.float32)
                    layer.nodes.append(nxt.name)
                    cur = nxt.outputs[0]
            layers.append(layer)
        elif node.op_type in ACTIVATIONS:
            if not layers or layers[-1].act != "none":
                raise NotFusable(f"{node.describe()}: an activation must follow a dense layer")
            layers[-1].act = ACTIVATIONS[node.op_type]
            if node.op_type == "LeakyRelu":
                layers[-1].alpha = float(op.attr("alpha", 0.01))
            layers[-1].nodes.append(node.name)
            cur = node.outputs[0]
        else:
            raise NotFusable(f"{node.describe()} is not a dense layer or a supported activation")
        t = plan.tensors[cur]
        if t.dtype is not dtypes.FLOAT or t.rank != 2:
            raise NotFusable(f"tensor '{cur}' is not a float32 [batch, features] row")
    if not layers:
        raise NotFusable("no dense layer between the input and the output")
    K0 = xin.kernel_shape[1]
    for i, l in enumerate(layers):
        want = K0 if i == 0 else layers[i - 1].N
        if l.K != want:
            raise NotFusable(f"layer {i} ({l.nodes[0]}) takes {l.K} features, the previous gives {want}")
    return FusedMLP(xin.name, yout.name, layers, K0)


# ---- the per-shape plan -----------------------------------------------------------------------


def _tilings(T: int, NT: int, Np: int) -> list[tuple[int, int]]:
    """Return the (samples, outputs) register tiles that cover a T x Np tile with <= NT threads."""
    out = []
    for S in (4, 8, 16):
        if T % S:
            continue
        for O in range(4, Np + 1, 4):
            if Np % O or S * O > max_acc():
                continue
            if (T // S) * (Np // O) <= NT:
                out.append((S, O))
    return out


def choose_tiling(T: int, NT: int, Np: int) -> tuple[int, int]:
    """Return the register tile for one layer: the fewest accumulators per thread (all threads
    busy), then the fewest shared loads per multiply-add ((S + O) / (4 S O))."""
    cands = _tilings(T, NT, Np)
    if not cands:
        raise NotFusable(f"no register tile fits {T} samples x {Np} outputs in {NT} threads")
    return min(cands, key=lambda so: (so[0] * so[1], (so[0] + so[1]) / (so[0] * so[1]), -so[0]))


def _largest_divisor_at_most(k: int, cap: int) -> int:
    return max(d for d in range(1, min(k, cap) + 1) if k % d == 0)


def plan_mlp(mlp: FusedMLP, mode: str = "gpu", precision: str = "fp32", T: int | None = None,
             NT: int | None = None, U: int | None = None) -> FusedMLP:
    """Choose the tile, the register tiles and where weights live for this shape; return mlp."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    mlp.precision, mlp.mode = precision, mode
    hidden = [l.Np for l in mlp.layers[:-1]] or [mlp.layers[-1].Np]
    widest = max(hidden)
    mlp.NT = NT or _env_int("LUISAML_FUSED_NT", 128 if mode == "gpu" else 16)
    if T is None:
        T = _env_int("LUISAML_FUSED_T", 0)
        if not T:
            # the widest hidden layer gets max_acc() accumulators a thread: the most multiply-adds
            # per shared-memory byte (which bounds FP32 FMA on Hopper: 128 B/clk for 128 FMA/clk)
            T = 16
            while T < 256 and 2 * T * widest <= max_acc() * mlp.NT and (mode != "gpu" or _act_fits(mlp, 2 * T)):
                T *= 2
            if mode != "gpu":
                T = min(T, 16)
    mlp.T = T
    U = U or _env_int("LUISAML_FUSED_U", 0)
    mlp.U = U or 4
    for l in mlp.layers:
        l.S, l.O = choose_tiling(mlp.T, mlp.NT, l.Np)
        forced = os.environ.get("LUISAML_FUSED_TILE")  # "SxO" for every layer it tiles (measurements)
        if forced:
            S, O = map(int, forced.split("x"))
            if mlp.T % S == 0 and l.Np % O == 0 and (mlp.T // S) * (l.Np // O) <= mlp.NT:
                l.S, l.O = S, O
    for i, l in enumerate(mlp.layers):
        l.Kc = mlp.padded_k(i)
        l.G = 1
    if mode == "gpu":
        act = mlp.vec_bytes * mlp.act_float4
        if act > SHARED_LIMIT - 4096:
            raise NotFusable(f"the activation tile ({act} B) leaves no shared memory for weights")
        mlp.weights = os.environ.get("LUISAML_FUSED_WEIGHTS") or "resident"
        if mlp.weights == "resident" and act + mlp.vec_bytes * mlp.wsh_float4 > SHARED_LIMIT:
            mlp.weights = "staged"
        if mlp.weights == "pipelined":
            # two chunk buffers, each a whole number of NT-float4 rounds (one register a round)
            per_buf = ((SHARED_LIMIT - act) // mlp.vec_bytes // 2) // mlp.NT * mlp.NT
            for i, l in enumerate(mlp.layers):
                l.Kc = _largest_divisor_at_most(mlp.padded_k(i), max(per_buf // l.Np4, 1))
        if mlp.weights == "staged":
            free4 = (SHARED_LIMIT - act) // mlp.vec_bytes
            widest4 = max(l.Np4 for l in mlp.layers)
            for i, l in enumerate(mlp.layers):
                # the same chunk rows for every layer: the shared weight array fits the widest one
                l.Kc = _largest_divisor_at_most(mlp.padded_k(i), max(free4 // widest4, 1))
            if not os.environ.get("LUISAML_FUSED_WEIGHTS") and min(l.Kc for l in mlp.layers) < 32:
                # chunks this thin cost two barriers per few rows: reading weights through L1 wins
                # (63-256x4-4: 11.1 ms global vs 11.5 ms staged; 63-128x4-4, 16-row chunks: 2.89 ms
                # vs 3.0, benchmarks/NOTES.md)
                mlp.weights = "global"
                for i, l in enumerate(mlp.layers):
                    l.Kc = mlp.padded_k(i)
    # the next tile's inputs in registers during the output layer: 32-32 0.834 -> 0.797 ms
    # (resident), 32-64 2.21 -> 2.03 (staged), 63-128 2.97 -> 2.89 (global, 64-sample tiles); but
    # 63-256 (global, 32-sample tiles) 10.4 -> 10.9
    prefetch = mlp.weights in ("resident", "staged", "pipelined") or mlp.T >= 64
    if "LUISAML_FUSED_PREFETCH" in os.environ:
        prefetch = os.environ["LUISAML_FUSED_PREFETCH"] == "1"
    mlp.prefetch = prefetch and mode == "gpu"
    # float4 accumulators: a quarter of the DSL lines (faster to build), as fast with resident
    # weights, but slower elsewhere once the operands load a k step ahead: 32-64 staged 1.951 ->
    # 1.990 ms, 63-256 global 9.87 -> 10.92 (benchmarks/NOTES.md)
    vector = mode == "gpu" and mlp.weights == "resident"
    mlp.vector_acc = vector if "LUISAML_FUSED_VECTOR" not in os.environ else os.environ["LUISAML_FUSED_VECTOR"] == "1"
    # sample-major threads store activations without bank conflicts; output-major (the first
    # design) kept for measurements: 32-64x3-4 spent a quarter of its shared-memory wavefronts on
    # 4-way conflicted stores (ncu, benchmarks/NOTES.md)
    mlp.sample_major = os.environ.get("LUISAML_FUSED_MAP", "samples") == "samples"
    # operands loaded a k step ahead: 32-32 0.772 -> 0.749 ms, 32-64 1.968 -> 1.951, 63-256 10.17 ->
    # 9.88; but with global weights and prefetched inputs (63-128) the extra registers cost more
    # (2.886 -> 2.934)
    kpipe = not (mlp.weights == "global" and mlp.prefetch)
    if "LUISAML_FUSED_KPIPE" in os.environ:
        kpipe = os.environ["LUISAML_FUSED_KPIPE"] == "1"
    mlp.kpipe = kpipe
    if not U:
        # 8 k-steps where every accumulation loop runs >= 32 rows (32-64x3-4 staged: 2.26 ms vs
        # 2.33), except global weights, where 8 cost a second of cold compile (3.9 s) for 4%
        rows = 16 if mlp.weights == "pipelined" else 32
        mlp.U = 8 if mlp.weights != "global" and min(l.Kc for l in mlp.layers) >= rows else 4
    _split_k(mlp)
    if mode == "gpu":
        # as many blocks as shared memory and the thread limit let an SM hold; the registers the
        # driver's compiler gives the kernel may allow fewer, and the blocks that wait find no tiles
        # left (the atomic tile counter) instead of running a second wave (32-64x3-4: 2.03 ms with
        # 3 resident blocks vs 2.21 ms when a fourth, static-striding block per SM waited)
        per_sm = 227 * 1024 // max(mlp.shared_bytes + 1024, 1)
        mlp.blocks_per_sm = _env_int("LUISAML_FUSED_BPS", max(1, min(per_sm, 2048 // mlp.NT, 32)))
    return mlp


def max_acc() -> int:
    """Accumulators a thread may hold (64 floats keep a thread near 120 registers)."""
    return _env_int("LUISAML_FUSED_ACC", MAX_ACC)


def _act_fits(mlp: FusedMLP, T: int) -> bool:
    """Whether a tile of T samples leaves room for a weight chunk in static shared memory."""
    rows = max(mlp.padded_k(i) for i in range(len(mlp.layers)))
    return rows * (T // 4 + 1) * mlp.vec_bytes <= SHARED_LIMIT - 8192


def _split_k(mlp: FusedMLP) -> None:
    """Give the output layer G > 1 K-groups when its register tiles leave threads idle, where its
    partial sums fit the activation tile (and, staged, its whole weight matrix fits one chunk)."""
    i = len(mlp.layers) - 1
    l, kp = mlp.layers[i], mlp.padded_k(i)
    if os.environ.get("LUISAML_FUSED_SPLITK") == "0" or mlp.NT % mlp.active(i):
        return
    G = mlp.NT // mlp.active(i)
    while G > 1 and kp % G:
        G -= 1
    if G < 2 or G * mlp.active(i) * l.S * l.O // 4 > mlp.act_float4:
        return
    if mlp.mode == "gpu" and mlp.weights in ("staged", "pipelined"):
        room = mlp.wsh_float4 if mlp.weights == "staged" else mlp.chunk_float4
        if kp * l.Np4 > room:  # the whole matrix must fit one chunk
            return
        l.Kc = kp
    l.G = G


def pack_weights(mlp: FusedMLP, blob) -> None:
    """Append each layer's packed record to the weight blob and remember its byte offset."""
    wsh = 0
    for i, l in enumerate(mlp.layers):
        rec = l.packed(mlp.padded_k(i))
        name = f"fused/{l.nodes[0]}"
        t = Tensor(name, dtypes.FLOAT, tuple(rec.shape), False, rec)
        l.w_off = blob.add(t)
        l.wsh_off = wsh
        wsh += mlp.padded_k(i) * l.Np4 + l.Np4
        if l.w_off % BLOB_ALIGN:
            raise CompileError(f"fused weights of {l.nodes[0]} are not 16-byte aligned in the blob")


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v else default


_SM_COUNT: int | None = None


def sm_count() -> int:
    """Return the multiprocessor count of CUDA device 0 (persistent blocks fill every SM)."""
    global _SM_COUNT
    if _SM_COUNT is None:
        _SM_COUNT = 132
        try:
            cuda = ctypes.CDLL("libcuda.so.1")
            dev, v = ctypes.c_int(0), ctypes.c_int(0)
            if cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0:
                if cuda.cuDeviceGetAttribute(ctypes.byref(v), 16, dev) == 0 and v.value > 0:
                    _SM_COUNT = v.value  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
        except OSError:
            pass
    return _SM_COUNT


# ---- code ----------------------------------------------------------------------------------------


def activation(layer: Layer, v: str) -> str:
    """Return the DSL of the layer's activation applied to the float expression v."""
    if layer.act == "relu":
        return f"max({v}, 0.0)"
    if layer.act == "leaky_relu":
        return f"({v} if {v} > 0.0 else {v} * {float(np.float32(layer.alpha))!r})"
    if layer.act == "sigmoid":
        return f"(1.0 / (1.0 + exp(-{v})))"
    if layer.act == "tanh":
        return f"tanh({v})"
    return v


def emit_kernel(plan, module) -> tuple[list[str], str, list[tuple[str, str]]]:
    """Return (kernel parameters, kernel body, module-level type declarations) of the fused kernel."""
    from .codegen import template_env

    f: FusedMLP = plan.fused
    xin, yout = plan.inputs[0], plan.outputs[0]
    if f.mode == "gpu":
        act_t, wsh_t, tile_t = f"ShAct_{f.act_float4}", f"ShW_{max(f.wsh_float4, 1)}", "ShTile"
        decls = [
            (act_t, f"luisa.SharedArrayType({f.act_float4}, float4)"),
            (wsh_t, f"luisa.SharedArrayType({max(f.wsh_float4, 1)}, float4)"),
            (tile_t, "luisa.SharedArrayType(1, int)"),
        ]
    else:
        act_t, wsh_t, tile_t = f"Act_{f.act_float4}", "", ""
        decls = [(act_t, f"luisa.ArrayType({f.act_float4}, float4)")]
    body = template_env().get_template("mlp.py.j2").render(
        f=f, x=xin.ident, y=yout.ident, n="n", tiles=TILE_COUNTER, act_t=act_t, wsh_t=wsh_t, tile_t=tile_t,
        io_half=f.precision == "fp16", activation=activation,
    )
    lines = ["    " + ln.rstrip() for ln in body.splitlines() if ln.strip()]
    return [xin.ident, yout.ident, "weights", TILE_COUNTER, "n: int"], "\n".join(lines), decls


def choose(plan, fuse: str, precision: str) -> tuple[FusedMLP | None, str]:
    """Return (the fused plan or None, a note for inspect) for fuse = "off" | "gpu" | "emulated"."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    try:
        mlp = find_mlp(plan)
        mode = fuse if fuse in ("gpu", "emulated") else "gpu"
        plan_mlp(mlp, mode, precision)
    except NotFusable as e:
        if precision != "fp32":
            raise CompileError(f"precision='{precision}' needs the fused MLP kernel, and this graph is not one: {e}") from None
        return None, f"not fused: {e}"
    except Exception as e:  # recognition must never break compiling a graph it does not fuse
        if fuse != "off" or precision != "fp32":
            raise
        return None, f"not fused: {type(e).__name__}: {e}"
    if fuse == "off" and precision == "fp32":
        return None, f"fusable (used on the CUDA backend): {mlp.describe()}"
    pack_weights(mlp, plan.blob)
    return mlp, mlp.describe()
