"""A GRU step's h_(t-1) . R^T (64 rows, 128 units, 3 gates) as the CPU backend runs it, by register
tile: SB rows x 4*Q units a work item, R prepacked [k][gate, unit] and read as float4s, h broadcast.
Prints the CPU time of one step over all rows (process time: the 2-core development host is shared)
and its GFLOP/s (benchmarks/NOTES.md, "Recurrent networks on the CPU, continued").

    python benchmarks/experiments/micro_rnn_step.py"""
import importlib.util
import tempfile
import time
from pathlib import Path

import luisa
import numpy as np

luisa.init("cpu")
from luisaml.luisa_compat import byte_buffer  # noqa: E402

H, G, B = 128, 3, 64
R = np.random.default_rng(0).random(H * G * H).astype(np.float32)


def kernel(SB: int, Q: int, unroll: int, act: bool) -> str:
    """Return the source of a kernel of SB rows x 4 * Q units, k unrolled `unroll` times (4: h read
    as four scalars once and broadcast lane by lane), with the GRU's activations when `act`."""
    lines = ["@luisa.func", "def rnn_tile(wb, hb, out):", "    set_block_size(1, 1, 1)", "    bg = dispatch_id().x",
             f"    for ug in range({H // (4 * Q)}):", f"        u0 = ug * {4 * Q}"]
    lines += [f"        a{j}_{g}_{q} = float4(0.0)" for j in range(SB) for g in range(G) for q in range(Q)]
    lines += [f"        for kk in range({H // unroll}):"]
    if unroll == 4:
        lines += [f"            hq{j} = float4(" + ", ".join(f"hb.read((bg * {SB} + {j}) * {H} + kk * 4 + {e})" for e in range(4)) + ")"
                  for j in range(SB)]
    for e in range(unroll):
        k = f"(kk * {unroll} + {e})" if unroll > 1 else "kk"
        lines += [f"            h{j} = float4(hq{j}.{'xyzw'[e]})" if unroll == 4 else
                  f"            h{j} = float4(hb.read((bg * {SB} + {j}) * {H} + {k}))" for j in range(SB)]
        lines += [f"            rk = {k} * {G * H * 4}"]
        lines += [f"            r{g}_{q} = wb.read(float4, rk + (u0 + {g * H + q * 4}) * 4)" for g in range(G) for q in range(Q)]
        lines += [f"            a{j}_{g}_{q} = fma(h{j}, r{g}_{q}, a{j}_{g}_{q})" for j in range(SB) for g in range(G) for q in range(Q)]
    if act:
        outs = []
        for j in range(SB):
            for q in range(Q):
                lines += [f"        z{j}_{q} = 1.0 / (1.0 + exp(-a{j}_0_{q}))", f"        r{j}_{q} = 1.0 / (1.0 + exp(-a{j}_1_{q}))",
                          f"        o{j}_{q} = (1.0 - z{j}_{q}) * tanh(a{j}_2_{q} * r{j}_{q}) + z{j}_{q}"]
                outs.append(f"o{j}_{q}")
    else:
        outs = [f"a{j}_{g}_{q}" for j in range(SB) for g in range(G) for q in range(Q)]
    lines += ["        s = " + " + ".join(outs), f"        out.write(bg * {G * H} + u0, s.x + s.y + s.z + s.w)"]
    return "\n".join(lines) + "\n"


def main() -> None:
    wb = byte_buffer(R.tobytes())
    hb = luisa.Buffer.from_array(np.random.default_rng(1).random(B * H).astype(np.float32))
    out = luisa.Buffer.from_array(np.zeros(B * G * H, np.float32))
    for SB, Q, unroll, act in [(1, 2, 1, False), (2, 2, 1, False), (4, 1, 1, False), (4, 1, 4, False),
                               (4, 2, 1, False), (8, 1, 1, False), (4, 1, 1, True)]:
        # luisa.func reads its source from a file: one module a tile
        path = Path(tempfile.mkdtemp()) / f"tile_{SB}_{Q}_{unroll}_{int(act)}.py"
        path.write_text("import luisa\nfrom luisa.mathtypes import *\n\n\n" + kernel(SB, Q, unroll, act))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        f, n = mod.rnn_tile, B // SB
        f(wb, hb, out, dispatch_size=n)
        luisa.synchronize()
        ts = []
        for _ in range(20):
            t = time.process_time()
            f(wb, hb, out, dispatch_size=n)
            luisa.synchronize()
            ts.append(time.process_time() - t)
        ms = min(ts) * 1e3
        print(f"{SB} x {4 * Q}{', k unrolled 4' if unroll == 4 else ''}{', activations' if act else ''}: "
              f"{ms:.3f} ms CPU a step, {2 * B * G * H * H / ms / 1e6:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
