"""The fused MLP operator: a chain of dense layers, each followed by any chain of elementwise
nodes (its activation), run as one cooperative kernel; its per-shape plan, whose knobs are an
`MLPConfig`; and its emission (shaders/mlp.py.j2).

In the kernel a block of threads shares a tile of samples, activations stay in shared memory,
weights are staged in shared memory (or read through L1), and every thread accumulates a register
tile of samples x outputs with float4 loads. On the CPU backend the same arithmetic runs
"emulated" (one CPU thread per block, a loop over the block's threads between barriers):
luisa-python 0.3.7's CPU backend cannot compile shared memory or sync_block. The plan's defaults
are what benchmarks/NOTES.md measured; designs measured and rejected there are not kept here."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from luisaml import dtypes
from luisaml.codegen import Inline, KernelContext, Module
from luisaml.device import sm_count
from luisaml.errors import CompileError, UsageError
from luisaml.model import Node
from luisaml.operator import Operator
from luisaml.safe_source import comment_text
from luisaml.storage import Local, Tensor, Value, bind

PRECISIONS = ("fp32", "fp16")
# Static __shared__ arrays (how LuisaCompute declares shared memory) are limited to 48 KiB a block.
SHARED_LIMIT = 48 * 1024
MAX_ACC = 64  # accumulators a thread holds: 64 floats keep a thread under ~128 registers
BLOB_ALIGN = 16
# kernel parameter: int buffer [next tile, blocks done], zero between launches (the last block
# resets it); the runtime owns one per compiled network
TILE_COUNTER = "tile_counter"
WEIGHT_MODES = ("resident", "staged", "global")


class NotFusable(Exception):
    """Why a graph is not a fusable MLP, or a shape the kernel cannot plan (said by inspect and by
    precision='fp16'; luisaml/rewrites/mlp.py raises it for the graph)."""


@dataclass(frozen=True)
class MLPConfig:
    """Knobs of the fused kernel's plan (luisaml.compile(..., mlp=MLPConfig(...))); None lets the
    planner choose per shape. For measurements and tests: the defaults are what measured fastest."""

    T: int | None = None  # samples per tile (a block works on one tile at a time)
    NT: int | None = None  # threads per block
    U: int | None = None  # k steps unrolled on the host inside the accumulation loop
    blocks_per_sm: int | None = None
    max_acc: int = MAX_ACC  # accumulators a thread may hold
    tile: tuple[int, int] | None = None  # (samples, outputs) register tile forced on every layer it fits
    weights: str | None = None  # "resident", "staged" or "global" (see FusedMLP.weights)
    prefetch: bool | None = None  # load the next tile's inputs during the output layer
    vector_acc: bool | None = None  # float4 accumulators instead of scalar ones
    kpipe: bool | None = None  # load the next k step's operands before this step's multiply-adds
    split_k: bool = True  # split a narrow output layer's K over thread groups

    def __post_init__(self) -> None:
        if self.weights is not None and self.weights not in WEIGHT_MODES:
            raise UsageError(f"MLPConfig.weights must be one of {', '.join(WEIGHT_MODES)}, not {self.weights!r}")


@dataclass
class Activation:
    """The elementwise nodes after a dense layer: from its output `h` to the tensor `out` the next
    layer reads (no nodes: none). In the kernel they apply to one accumulator at a time, each
    node's element() with h bound to that value and the nodes between as inline expressions."""

    h: Tensor | None = None
    out: Tensor | None = None
    nodes: list[tuple[Node, Operator]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return comment_text("+".join(n.op_type for n, _ in self.nodes) or "none")

    def expr(self, module: Module, v: str, col: str) -> str:
        """Return the DSL of the activation of value v (float) at output column `col`."""
        if not self.nodes:
            return v
        ctx = KernelContext(module)
        ctx.pure = True
        table = {self.h: Value(f"({v})")}
        for node, op in self.nodes:
            if op.outputs[0] is not self.out:
                table[op.outputs[0]] = Inline(op, 0, module)
        end = next(op for _, op in self.nodes if op.outputs[0] is self.out)
        with bind(table):
            return end.element(ctx, col, 0)


@dataclass
class Layer:
    """One dense layer y = act(x W + b) with W as [K, N] (float32, alpha and transposes folded)."""

    weight: np.ndarray
    bias: np.ndarray
    act: Activation
    nodes: list[str] = field(default_factory=list)
    # chosen per shape by FusedMLP.plan
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

    @property
    def label(self) -> str:
        """The layer's nodes, for a comment in the kernel (escaped: they are model text)."""
        return comment_text(", ".join(self.nodes))

    def packed(self, Kp: int) -> np.ndarray:
        """Return the blob record: W as [Kp][Np] (zero padded) followed by the bias [Np]."""
        w = np.zeros((Kp, self.Np), np.float32)
        w[: self.K, : self.N] = self.weight
        b = np.zeros(self.Np, np.float32)
        b[: self.N] = self.bias
        return np.concatenate([w.reshape(-1), b])


class FusedMLP(Operator):
    """One node standing for a chain of dense layers and their activations (luisaml/rewrites/mlp.py
    rewrites the chain into it): input 0 [batch, K0] -> output 0 [batch, N]. The stage it runs in is its
    cooperative kernel; `forward` (one sample, for user kernels) emits the original nodes."""

    stores_once = True
    own_kernel = True
    kernel_counters = (TILE_COUNTER,)

    def __init__(self, node: Node, x: Tensor, y: Tensor, layers: list[Layer], chain: list[tuple[Node, Operator]],
                 intermediates: list[Tensor]):
        self.layers = layers
        self.chain = chain
        self.intermediates = intermediates
        self.K0 = x.shape[1]
        self.precision, self.mode = "fp32", "gpu"
        self.T, self.NT, self.U = 128, 128, 4
        self.weights = "resident"  # all layers in shared memory; "staged": Kc rows at a time; "global": from the blob
        self.blocks_per_sm = 4
        self.prefetch = self.vector_acc = self.kpipe = False
        super().__init__(node, [x], [y], 1)

    # ---- the per-sample form ------------------------------------------------------------------
    def forward(self, ctx) -> None:
        """The chain's own nodes, one sample, intermediates in local arrays."""
        table = {t: Local(ctx.local_array(t.dtype.dsl, t.numel, "h")) for t in self.intermediates}
        with bind(table):
            for node, op in self.chain:
                ctx.comment(f"{comment_text(node.name)}: {node.op_type}")
                op.forward(ctx)

    # ---- plan ---------------------------------------------------------------------------------
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
    def wsh_float4(self) -> int:
        """float4 elements of the shared weight array."""
        if self.mode != "gpu" or self.weights == "global":
            return 0
        if self.resident:
            return sum(self.padded_k(i) * l.Np4 + l.Np4 for i, l in enumerate(self.layers))
        return max(l.Kc * l.Np4 for l in self.layers)

    @property
    def shared_bytes(self) -> int:
        return 16 * (self.act_float4 + self.wsh_float4) if self.mode == "gpu" else 0

    @property
    def flops_per_sample(self) -> int:
        return sum(2 * l.K * l.N for l in self.layers)

    def describe(self) -> str:
        """One line for inspect: what the fused kernel does for this shape."""
        dims = "-".join([str(self.K0)] + [str(l.N) for l in self.layers])
        acts = ",".join(l.act.label for l in self.layers)
        tiles = " ".join(
            f"{l.S}x{l.O}" + (f"/k{l.Kc}" if self.weights == "staged" else "") + (f" split-K {l.G}" if l.G > 1 else "")
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

    def plan(self, mode: str = "gpu", precision: str = "fp32", config: MLPConfig | None = None) -> FusedMLP:
        """Choose the tile, the register tiles and where weights live for this shape."""
        cfg = config or MLPConfig()
        if precision not in PRECISIONS:
            raise UsageError(f"precision must be one of {PRECISIONS}, not {precision!r}")
        self.precision, self.mode = precision, mode
        hidden = [l.Np for l in self.layers[:-1]] or [self.layers[-1].Np]
        widest = max(hidden)
        self.NT = cfg.NT or (128 if mode == "gpu" else 16)
        T = cfg.T
        if not T:
            # the widest hidden layer gets max_acc accumulators a thread: the most multiply-adds per
            # shared-memory byte (which bounds FP32 FMA on Hopper: 128 B/clk for 128 FMA/clk)
            T = 16
            while T < 256 and 2 * T * widest <= cfg.max_acc * self.NT and (mode != "gpu" or self._act_fits(2 * T)):
                T *= 2
            if mode != "gpu":
                T = min(T, 16)
        self.T = T
        for l in self.layers:
            l.S, l.O = choose_tiling(self.T, self.NT, l.Np, cfg.max_acc)
            if cfg.tile:
                S, O = cfg.tile
                if self.T % S == 0 and l.Np % O == 0 and (self.T // S) * (l.Np // O) <= self.NT:
                    l.S, l.O = S, O
        for i, l in enumerate(self.layers):
            l.Kc = self.padded_k(i)
            l.G = 1
        if mode == "gpu":
            act = 16 * self.act_float4
            if act > SHARED_LIMIT - 4096:
                raise NotFusable(f"the activation tile ({act} B) leaves no shared memory for weights")
            self.weights = cfg.weights or "resident"
            if self.weights == "resident" and act + 16 * self.wsh_float4 > SHARED_LIMIT:
                self.weights = "staged"
            if self.weights == "staged":
                free4 = (SHARED_LIMIT - act) // 16
                widest4 = max(l.Np4 for l in self.layers)
                for i, l in enumerate(self.layers):
                    # the same chunk rows for every layer: the shared weight array fits the widest one
                    l.Kc = _largest_divisor_at_most(self.padded_k(i), max(free4 // widest4, 1))
                if not cfg.weights and min(l.Kc for l in self.layers) < 32:
                    # chunks this thin cost two barriers per few rows: reading weights through L1 wins
                    # (63-256x4-4: 11.1 ms global vs 11.5 ms staged; 63-128x4-4, 16-row chunks: 2.89
                    # ms vs 3.0, benchmarks/NOTES.md)
                    self.weights = "global"
                    for i, l in enumerate(self.layers):
                        l.Kc = self.padded_k(i)
        else:
            self.weights = "global"
        # the next tile's inputs in registers during the output layer: 32-32 0.834 -> 0.797 ms
        # (resident), 32-64 2.21 -> 2.03 (staged), 63-128 2.97 -> 2.89 (global, 64-sample tiles);
        # but 63-256 (global, 32-sample tiles) 10.4 -> 10.9
        prefetch = self.weights in ("resident", "staged") or self.T >= 64
        self.prefetch = (prefetch if cfg.prefetch is None else cfg.prefetch) and mode == "gpu"
        # float4 accumulators: a quarter of the DSL lines (faster to build), as fast with resident
        # weights, but slower elsewhere once the operands load a k step ahead: 32-64 staged 1.951 ->
        # 1.990 ms, 63-256 global 9.87 -> 10.92 (benchmarks/NOTES.md)
        vector = mode == "gpu" and self.weights == "resident"
        self.vector_acc = vector if cfg.vector_acc is None else cfg.vector_acc
        # operands loaded a k step ahead: 32-32 0.772 -> 0.749 ms, 32-64 1.968 -> 1.951, 63-256 10.17
        # -> 9.88; but with global weights and prefetched inputs (63-128) the extra registers cost
        # more (2.886 -> 2.934)
        kpipe = not (self.weights == "global" and self.prefetch)
        self.kpipe = kpipe if cfg.kpipe is None else cfg.kpipe
        # 8 k-steps where every accumulation loop runs >= 32 rows (32-64x3-4 staged: 2.26 ms vs
        # 2.33), except global weights, where 8 cost a second of cold compile (3.9 s) for 4%
        self.U = cfg.U or (8 if self.weights != "global" and min(l.Kc for l in self.layers) >= 32 else 4)
        if cfg.split_k:
            self._split_k()
        if mode == "gpu":
            # as many blocks as shared memory and the thread limit let an SM hold; the registers the
            # driver's compiler gives the kernel may allow fewer, and the blocks that wait find no
            # tiles left (the atomic tile counter) instead of running a second wave (32-64x3-4:
            # 2.03 ms with 3 resident blocks vs 2.21 ms when a fourth, static-striding block waited)
            per_sm = 227 * 1024 // max(self.shared_bytes + 1024, 1)
            self.blocks_per_sm = cfg.blocks_per_sm or max(1, min(per_sm, 2048 // self.NT, 32))
        return self

    def _act_fits(self, T: int) -> bool:
        """Whether a tile of T samples leaves room for a weight chunk in static shared memory."""
        rows = max(self.padded_k(i) for i in range(len(self.layers)))
        return rows * (T // 4 + 1) * 16 <= SHARED_LIMIT - 8192

    def _split_k(self) -> None:
        """Give the output layer G > 1 K-groups when its register tiles leave threads idle, where
        its partial sums fit the activation tile (and, staged, its whole matrix fits one chunk)."""
        i = len(self.layers) - 1
        l, kp = self.layers[i], self.padded_k(i)
        if self.NT % self.active(i):
            return
        G = self.NT // self.active(i)
        while G > 1 and kp % G:
            G -= 1
        if G < 2 or G * self.active(i) * l.S * l.O // 4 > self.act_float4:
            return
        if self.mode == "gpu" and self.weights == "staged":
            if kp * l.Np4 > self.wsh_float4:  # the whole matrix must fit one chunk
                return
            l.Kc = kp
        l.G = G

    def pack_weights(self, blob) -> None:
        """Append each layer's packed record to the weight blob and remember its byte offset."""
        wsh = 0
        for i, l in enumerate(self.layers):
            rec = l.packed(self.padded_k(i))
            t = Tensor(f"fused/{l.nodes[0]}", dtypes.FLOAT, tuple(rec.shape), False, rec)
            l.w_off = blob.add(t)
            l.wsh_off = wsh
            wsh += self.padded_k(i) * l.Np4 + l.Np4
            if l.w_off % BLOB_ALIGN:
                raise CompileError(f"fused weights of {l.nodes[0]} are not 16-byte aligned in the blob")

    # ---- the kernel ---------------------------------------------------------------------------
    def emit_kernel(self, module: Module, x: str, y: str, n: str) -> tuple[str, list[tuple[str, str]]]:
        """Return (the kernel body, module-level type declarations) reading buffer x, writing y."""
        from luisaml.codegen import template_env

        if self.mode == "gpu":
            act_t, wsh_t, tile_t = f"ShAct_{self.act_float4}", f"ShW_{max(self.wsh_float4, 1)}", "ShTile"
            decls = [
                (act_t, f"luisa.SharedArrayType({self.act_float4}, float4)"),
                (wsh_t, f"luisa.SharedArrayType({max(self.wsh_float4, 1)}, float4)"),
                (tile_t, "luisa.SharedArrayType(1, int)"),
            ]
        else:
            act_t, wsh_t, tile_t = f"Act_{self.act_float4}", "", ""
            decls = [(act_t, f"luisa.ArrayType({self.act_float4}, float4)")]
        body = template_env().get_template("mlp.py.j2").render(
            f=self, x=x, y=y, n=n, tiles=TILE_COUNTER, act_t=act_t, wsh_t=wsh_t, tile_t=tile_t,
            io_half=self.precision == "fp16",
            activation=lambda layer, v, col: layer.act.expr(module, v, col),
        )
        lines = ["    " + ln.rstrip() for ln in body.splitlines() if ln.strip()]
        return "\n".join(lines), decls


def _tilings(T: int, NT: int, Np: int, max_acc: int) -> list[tuple[int, int]]:
    """Return the (samples, outputs) register tiles that cover a T x Np tile with <= NT threads."""
    out = []
    for S in (4, 8, 16):
        if T % S:
            continue
        for O in range(4, Np + 1, 4):
            if Np % O or S * O > max_acc:
                continue
            if (T // S) * (Np // O) <= NT:
                out.append((S, O))
    return out


def choose_tiling(T: int, NT: int, Np: int, max_acc: int = MAX_ACC) -> tuple[int, int]:
    """Return the register tile for one layer: the fewest accumulators per thread (all threads
    busy), then the fewest shared loads per multiply-add ((S + O) / (4 S O))."""
    cands = _tilings(T, NT, Np, max_acc)
    if not cands:
        raise NotFusable(f"no register tile fits {T} samples x {Np} outputs in {NT} threads")
    return min(cands, key=lambda so: (so[0] * so[1], (so[0] + so[1]) / (so[0] * so[1]), -so[0]))


def _largest_divisor_at_most(k: int, cap: int) -> int:
    return max(d for d in range(1, min(k, cap) + 1) if k % d == 0)
