"""Where bench_detector's device bytes go (issue 28, benchmarks/NOTES.md "Where the detector's device memory
goes"): the detector of bench_detector.py compiled and run over its frames file, every buffer luisaml makes
(luisaml/counts.py `allocated`) kept with its size, its pool identifier and its owner (A = the backbone's
pool, B = the head's, the device grid builds' pools, the byte inputs' BoundInputs), then the live ones
summed by owner after the frames. The sum equals counts' held_bytes.

    python -P benchmarks/detector_memory.py --quick                     # tiny frames, the CPU's host builds
    python -P benchmarks/detector_memory.py --grid-build device         # full frames, CUDA's device builds
"""
from __future__ import annotations

import argparse
import collections
import gc
import sys
import weakref
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the example test's tiny detector and frames")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--grid-build", choices=("device", "host"), help="where grids are built (default: the backend's)")
    ap.add_argument("--passes", type=int, default=1, help="passes over the frames")
    ap.add_argument("--top", type=int, default=20, help="the largest buffers listed")
    a = ap.parse_args(argv)

    from luisaml import counts, feeds, pool

    live: dict[int, tuple] = {}
    owner: list = [None]  # (identifier, owner's id) of the buffer being made
    allocated = counts.allocated

    def tracked(buf):
        allocated(buf)
        key = id(buf)
        live[key] = (int(getattr(buf, "bytesize", 0)),) + (owner[0] or ("?", None))
        weakref.finalize(buf, live.pop, key, None)
        return buf

    patched = [(counts, "allocated"), (pool.BufferPool, "exact"), (pool.SharedBuffers, "pooled"),
               (pool.BufferPool, "weights"), (pool.BufferPool, "run_state"), (feeds.BoundInputs, "byte_input"),
               (feeds.BoundInputs, "derived_buffers")]
    saved = [(obj, name, getattr(obj, name)) for obj, name in patched]
    try:
        counts.allocated = tracked
        return _run(a, counts, feeds, pool, live, owner, owned_factory(owner))
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def owned_factory(owner: list):
    def owned(method, ident_of):
        def wrapper(self, *args):
            owner[0] = (ident_of(*args), id(self))
            try:
                return method(self, *args)
            finally:
                owner[0] = None
        return wrapper
    return owned


def _run(a, counts, feeds, pool, live: dict, owner: list, owned) -> int:

    pool.BufferPool.exact = owned(pool.BufferPool.exact, lambda ident, *_: ident)
    pool.SharedBuffers.pooled = owned(pool.SharedBuffers.pooled, lambda ident, *_: ident)
    pool.BufferPool.weights = owned(pool.BufferPool.weights, lambda *_: "weights")
    pool.BufferPool.run_state = owned(pool.BufferPool.run_state, lambda *_: "run state")
    feeds.BoundInputs.byte_input = owned(feeds.BoundInputs.byte_input, lambda s, *_: "blob:" + s.ident)
    feeds.BoundInputs.derived_buffers = owned(feeds.BoundInputs.derived_buffers, lambda *_: "derived")

    import bench_detector as bd
    import luisaml

    settings = dict(bd.SIZES["quick" if a.quick else "full"])
    path = HERE / "results" / f"detector-frames{'-quick' if a.quick else ''}.npz"
    if not path.exists():
        bd.write_frames(path, settings)
    data = bd.read_frames(path)
    backend = luisaml.device.init(a.device)
    ex = bd.example()
    cfg, backbone, head = bd.modules(ex, data)
    nets = ex.compile_networks(cfg, backbone, head, data["points"][0], backend=backend,
                               **({"grid_build": a.grid_build} if a.grid_build else {}))
    names = {id(nets.a.pool): "A (backbone)", id(nets.b.pool): "B (head)", id(nets.a.bound): "A (backbone)",
             id(nets.b.bound): "B (head)"}
    for k, points in enumerate(list(data["points"]) * a.passes):
        with counts.measure() as c:
            nets.run(points)
        print(f"frame {k}: {len(points):,} points, held {c.held_bytes:,}, peak {c.peak_bytes:,}, launches "
              f"{c.launches}, syncs {c.syncs}, uploads {c.uploads}, downloads {c.downloads}")
    gc.collect()
    by = collections.Counter()
    for size, ident, who in live.values():
        kind = "blobs (byte inputs)" if ident.startswith("blob:") else "stage slots, scratch" \
            if ident.startswith(("buf_", "scratch_")) else "weights" if ident == "weights" else \
            "inputs, outputs" if ident.startswith(("x_", "y_")) else ident
        mine = names.get(who, "grid builds (shared)" if who is not None and ident.startswith(("buf_", "scratch_"))
                         and who not in names else "grid builds" if who is not None else "?")
        by[f"{mine}: {kind}"] += size
    total = sum(by.values())
    print(f"\nheld {counts.snapshot().held_bytes:,} bytes; tracked {total:,}")
    for what, size in by.most_common():
        print(f"{size:>15,}  {what}")
    print(f"\nthe {a.top} largest buffers:")
    for size, ident, who in sorted(live.values(), key=lambda v: -v[0])[:a.top]:
        print(f"{size:>15,}  {ident}  ({names.get(who, 'grid build' if who else '?')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
