"""NanoVDB: damaged .nvdb files and grid buffers, read on the host and bound to kernels.

A small OnIndex grid (two root tiles, a few hundred voxels) is written as a raw grid buffer and as
a segmented .nvdb file (codec none and zip), then damaged: flipped bytes (biased towards the
headers, where a flip means most), truncation, and field edits that claim absurd sizes (a 2**64
grid, 2**32 leaves, a 2**32-byte name, a zip chunk past the end, a decompression bomb), NaN
transforms, wrong grid types. Three actions:
- read: luisaml.fvdb.read_nvdb(path); an error must name the file.
- kernel: the damaged grid as the run-time grid_blob of an IJKToIndex network; an error must
  name the grid input; an accepted grid's lookups must equal the host reader's (luisaml.fvdb's
  numpy reader, which tests/fvdb checks against warp).
- constant: the damaged grid as GridFromNanoVDB's constant; an error must name the node.
"""
from __future__ import annotations

import struct

import numpy as np
from onnx import TensorProto, helper

from ..harness import (
    FAIL_HARNESS,
    FAIL_WRONG,
    Case,
    Fail,
    MustFail,
    attempt,
    judge,
    recipe,
)
from ..models import make_model, save, vi

FORMATS = ("raw", "none", "zip")
GRID_OFF = {"magic": 0, "checksum": 8, "version": 16, "flags": 20, "grid_index": 24, "grid_count": 28,
            "grid_size": 32, "name": 40, "map": 296, "world_bbox": 560, "voxel_size": 608, "grid_class": 632,
            "grid_type": 636, "blind_offset": 640, "blind_count": 648, "data1": 656}
TREE = 672  # TreeData follows GridData
ROOT_AT = 672 + 64


def _voxels() -> np.ndarray:
    rng = np.random.default_rng(21)
    return np.concatenate([rng.integers(-40, 40, (300, 3)), [[5000, 5000, 5000], [-4097, 0, 5]]]).astype(np.int32)


def grid_bytes() -> bytes:
    from luisaml.fvdb import build_grid

    return bytes(build_grid(_voxels(), voxel_size=0.5, origin=(1.0, -2.0, 0.5), name="robust_grid"))


def encode(raw: bytes, fmt: str) -> bytes:
    from luisaml.fvdb import encode_nvdb

    return raw if fmt == "raw" else encode_nvdb(raw, codec=fmt)


def _grid_start(data: bytes, fmt: str) -> int:
    """Return where the (uncompressed) grid starts in a file of this format."""
    if fmt == "raw":
        return 0
    (name_size,) = struct.unpack_from("<I", data, 16 + 136)  # FileMetaData nameSize
    return 16 + 176 + name_size + (8 if fmt == "zip" else 0)


def _put(b: bytearray, at: int, fmt: str, value) -> None:
    struct.pack_into(fmt, b, at, value)


def grid_edit(raw: bytes, kind: str) -> bytes:
    """Return the raw grid with one field set to an absurd value."""
    b = bytearray(raw)
    edits = {
        "grid_size_max": (GRID_OFF["grid_size"], "<Q", 2**64 - 1),
        "grid_size_small": (GRID_OFF["grid_size"], "<Q", 64),
        "grid_count_max": (GRID_OFF["grid_count"], "<I", 2**32 - 1),
        "grid_index_big": (GRID_OFF["grid_index"], "<I", 7),
        "leaf_count_huge": (TREE + 32, "<I", 2**32 - 1),
        "upper_count_huge": (TREE + 40, "<I", 2**31),
        "leaf_offset_huge": (TREE + 0, "<q", 2**62),
        "leaf_offset_negative": (TREE + 0, "<q", -(2**40)),
        "root_offset_huge": (TREE + 24, "<q", 2**62),
        "voxel_count_huge": (TREE + 56, "<Q", 2**64 - 1),
        "root_table_size_huge": (ROOT_AT + 24, "<I", 2**32 - 1),
        "blind_count_huge": (GRID_OFF["blind_count"], "<I", 2**32 - 1),
        "blind_offset_huge": (GRID_OFF["blind_offset"], "<q", 2**62),
        "data1_huge": (GRID_OFF["data1"], "<Q", 2**64 - 1),
        "voxel_size_zero": (GRID_OFF["voxel_size"], "<d", 0.0),
        "voxel_size_nan": (GRID_OFF["voxel_size"], "<d", float("nan")),
        "world_bbox_inf": (GRID_OFF["world_bbox"], "<d", float("inf")),
        "map_nan": (GRID_OFF["map"], "<f", float("nan")),
        "grid_type_float": (GRID_OFF["grid_type"], "<I", 1),
        "grid_class_bad": (GRID_OFF["grid_class"], "<I", 77),
        "flags_long_name": (GRID_OFF["flags"], "<I", 1),
        "magic_zero": (GRID_OFF["magic"], "<Q", 0),
        "version_old": (GRID_OFF["version"], "<I", (31 << 21)),
    }
    if kind == "name_no_nul":
        b[GRID_OFF["name"] : GRID_OFF["name"] + 256] = b"a" * 256
        return bytes(b)
    at, fmt, value = edits[kind]
    _put(b, at, fmt, value)
    return bytes(b)


GRID_EDITS = ("grid_size_max", "grid_size_small", "grid_count_max", "grid_index_big", "leaf_count_huge",
              "upper_count_huge", "leaf_offset_huge", "leaf_offset_negative", "root_offset_huge", "voxel_count_huge",
              "root_table_size_huge", "blind_count_huge", "blind_offset_huge", "data1_huge", "voxel_size_zero",
              "voxel_size_nan", "world_bbox_inf", "map_nan", "grid_type_float", "grid_class_bad", "flags_long_name",
              "magic_zero", "version_old", "name_no_nul")


def file_edit(data: bytes, fmt: str, kind: str) -> bytes:
    """Return a segmented file with one header field set to an absurd value."""
    b = bytearray(data)
    meta = 16
    if kind == "meta_grid_size_max":
        _put(b, meta + 0, "<Q", 2**64 - 1)
    elif kind == "meta_grid_size_2p63":
        _put(b, meta + 0, "<Q", 2**63)
    elif kind == "meta_grid_size_2p40":
        _put(b, meta + 0, "<Q", 2**40)
    elif kind == "meta_grid_size_zero":
        _put(b, meta + 0, "<Q", 0)
    elif kind == "name_size_max":
        _put(b, meta + 136, "<I", 2**32 - 1)
    elif kind == "file_grid_count_zero":
        _put(b, 12, "<H", 0)
    elif kind == "file_grid_count_max":
        _put(b, 12, "<H", 0xFFFF)
    elif kind == "codec_blosc":
        _put(b, 14, "<H", 2)
    elif kind == "codec_7":
        _put(b, 14, "<H", 7)
    elif kind == "version_31":
        _put(b, 8, "<I", 31 << 21)
    elif kind == "magic_wrong":
        _put(b, 0, "<Q", 0x1234)
    elif kind == "zip_chunk_max":
        _put(b, _grid_start(data, fmt) - 8, "<Q", 2**64 - 1)
    elif kind == "zip_chunk_zero":
        _put(b, _grid_start(data, fmt) - 8, "<Q", 0)
    elif kind == "trailing_garbage":
        b += b"\x01" * 100
    else:
        raise Fail(FAIL_HARNESS, f"unknown file edit {kind!r}")
    return bytes(b)


FILE_EDITS = {"none": ("meta_grid_size_max", "meta_grid_size_2p63", "meta_grid_size_2p40", "meta_grid_size_zero",
                       "name_size_max", "file_grid_count_zero", "file_grid_count_max", "codec_blosc", "codec_7", "version_31",
                       "magic_wrong", "trailing_garbage"),
              "zip": ("meta_grid_size_max", "meta_grid_size_2p63", "meta_grid_size_2p40", "meta_grid_size_zero",
                      "name_size_max", "zip_chunk_max", "zip_chunk_zero", "file_grid_count_max", "trailing_garbage")}


def zip_bomb(claim: int) -> bytes:
    """A one-grid zip .nvdb whose chunk inflates to 256 MiB of zeros, claiming `claim` bytes."""
    import zlib

    from luisaml.fvdb import encode_nvdb

    data = bytearray(encode_nvdb(grid_bytes(), codec="zip"))
    start = _grid_start(bytes(data), "zip")
    comp = zlib.compressobj(9)
    chunk = b"".join(comp.compress(bytes(1 << 24)) for _ in range(16)) + comp.flush()
    _put(data, 16, "<Q", claim)
    return bytes(data[: start - 8]) + struct.pack("<Q", len(chunk)) + chunk


def flip(data: bytes, seed: int, start: int) -> bytes:
    """Flip one byte: half the time in the first 1 KiB of the grid (its headers), else anywhere."""
    rng = np.random.default_rng(seed)
    b = bytearray(data)
    i = start + int(rng.integers(min(1024, len(b) - start))) if rng.random() < 0.5 else int(rng.integers(len(b)))
    b[i] ^= int(rng.integers(1, 256))
    return bytes(b)


def damaged_file(fmt: str, kind: str, seed: int) -> bytes:
    raw = grid_bytes()
    if kind == "flip":
        data = encode(raw, fmt)
        return flip(data, seed, _grid_start(data, fmt) if fmt != "zip" else 0)
    if kind == "truncate":
        data = encode(raw, fmt)
        return data[: int(np.random.default_rng(seed).integers(1, len(data)))]
    if kind in GRID_EDITS:
        edited = grid_edit(raw, kind)
        if fmt == "raw":
            return edited
        # a grid the writer would refuse: wrap it by hand, as a hostile writer would
        return _wrap(edited, fmt, raw)
    if kind == "zip_bomb_claim_2p40":
        return zip_bomb(2**40)
    if kind == "zip_bomb_claim_small":
        return zip_bomb(1 << 20)
    if kind == "empty":
        return b""
    if kind == "random":
        return np.random.default_rng(seed).bytes(4096)
    return file_edit(encode(raw, fmt), fmt, kind)


def _wrap(grid: bytes, fmt: str, good: bytes) -> bytes:
    """Return a .nvdb file of the good grid with its grid bytes replaced by `grid`."""
    import zlib

    data = encode(good, fmt)
    start = _grid_start(data, fmt)
    if fmt == "none":
        return data[:start] + grid
    comp = zlib.compress(grid)
    return data[: start - 8] + struct.pack("<Q", len(comp)) + comp


@recipe("nvdb.read")
def read(ctx, fmt: str, kind: str, seed: int = 0) -> None:
    from luisaml import fvdb

    path = ctx.path("grid.nvdb")
    path.write_bytes(damaged_file(fmt, kind, seed))
    a = attempt(fvdb.read_nvdb, str(path))
    # the file, or the grid by its position (what the probe judged a clear message already)
    judge(a, offender=("grid.nvdb", "NanoVDB grid #", "grid #0", "grid 0"), what="read_nvdb")
    if a.ok:  # accepted: the grids must be usable without a non-luisaml error
        for g in a.value:
            b = attempt(lambda: fvdb.ijk_to_index(g, fvdb.active_voxels(g)))
            judge(b, offender=("grid",), what="lookups in an accepted grid")


# ---- grids bound to kernels ---------------------------------------------------------------------

def _probes() -> np.ndarray:
    v = _voxels()
    rng = np.random.default_rng(3)
    return np.concatenate([v, v + 1, rng.integers(-60, 60, (100, 3))]).astype(np.int32)


def lookup_model():
    """IJKToIndex over the GridBatch bundle and one jagged ijk input, one instance."""
    from luisaml.opsets import fvdb as schema

    from luisaml.fvdb import GridBatch, JaggedTensor

    gb = GridBatch.from_ijk([_voxels()], voxel_sizes=0.5, origins=(1.0, -2.0, 0.5))
    probes = JaggedTensor.from_list([_probes()])
    feeds = dict(zip(schema.BUNDLE, gb.bundle()))
    feeds.update({f"ijk_{p}": a for p, a in zip(schema.JAGGED, probes.bundle())})
    node = helper.make_node("IJKToIndex", schema.OPS["IJKToIndex"].input_names(), ["index"], name="lookup",
                            domain=schema.DOMAIN)
    elem = {np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.int64): TensorProto.INT64,
            np.dtype(np.int32): TensorProto.INT32, np.dtype(np.float64): TensorProto.DOUBLE,
            np.dtype(np.float32): TensorProto.FLOAT}
    ins = [vi(k, elem[np.asarray(v).dtype], list(np.shape(v))) for k, v in feeds.items()]
    m = make_model([node], ins, [vi("index", TensorProto.INT64, [len(probes.jdata)])], opset=17, infer=False)
    m.opset_import.append(helper.make_opsetid(schema.DOMAIN, 1))
    return m, feeds


@recipe("nvdb.kernel")
def kernel(ctx, kind: str, seed: int = 0) -> None:
    """A damaged grid bound at run time: refused naming the grid, or looked up as the host does."""
    import luisaml
    from luisaml import fvdb

    model, feeds = lookup_model()
    a = attempt(luisaml.compile, save(model, ctx.path("lookup.onnx")), batch_axis=None)
    judge(a, error_ok=False, what="compiling the lookup network")
    net = a.value
    raw = grid_bytes()
    bad = flip(raw, seed, 0) if kind == "flip" else grid_edit(raw, kind)
    blob = np.frombuffer(bad, np.uint8).copy()
    run = attempt(net.run, {**feeds, "grid_blob": blob})
    host = attempt(lambda: fvdb.ijk_to_index(fvdb.read_grid(bad), _probes()))
    if run.ok and not host.ok:
        raise Fail(FAIL_WRONG, f"the kernel accepted a grid the host reader refuses ({host.describe()})")
    ref = {"index": host.value} if host.ok else MustFail("a grid the host reader refuses")
    judge(run, offender=("grid_blob", "NanoVDB grid", "grid #0", "grid 0", "lookup"), reference=ref, what="run")


@recipe("nvdb.constant")
def constant(ctx, kind: str, seed: int = 0) -> None:
    """A damaged grid as GridFromNanoVDB's constant: a compile error naming the node."""
    from luisaml.opsets import fvdb as schema

    import luisaml

    raw = grid_bytes()
    bad = flip(raw, seed, 0) if kind == "flip" else grid_edit(raw, kind)
    nodes = [helper.make_node("GridFromNanoVDB", ["raw"], list(schema.BUNDLE), name="g_from_blob", domain="fvdb"),
             helper.make_node("IJKToIndex", schema.OPS["IJKToIndex"].input_names(), ["index"], name="lookup",
                              domain="fvdb")]
    from luisaml.fvdb import JaggedTensor

    probes = JaggedTensor.from_list([_probes()])
    feeds = {f"ijk_{p}": a for p, a in zip(schema.JAGGED, probes.bundle())}
    elem = {np.dtype(np.int64): TensorProto.INT64, np.dtype(np.int32): TensorProto.INT32}
    ins = [vi(k, elem[v.dtype], list(v.shape)) for k, v in feeds.items()]
    m = make_model(nodes, ins, [vi("index", TensorProto.INT64, [len(probes.jdata)])],
                   {"raw": np.frombuffer(bad, np.uint8).copy()}, opset=17, infer=False)
    m.opset_import.append(helper.make_opsetid("fvdb", 1))
    a = attempt(lambda: luisaml.compile(save(m, ctx.path("constant.onnx")), batch_axis=None).run(feeds))
    from luisaml import fvdb

    host = attempt(lambda: fvdb.ijk_to_index(fvdb.read_grid(bad), _probes()))
    ref = {"index": host.value} if host.ok else MustFail("a grid the host reader refuses")
    judge(a, offender=("g_from_blob", "raw"), reference=ref, what="GridFromNanoVDB")


_CI = {("zip", "meta_grid_size_max"), ("raw", "flip"), ("none", "truncate"), ("raw", "leaf_count_huge"),
       ("zip", "zip_bomb_claim_2p40")}


def cases() -> list[Case]:
    out = []
    for fmt in FORMATS:
        for seed in range(16):
            out.append(Case(f"nvdb/read/{fmt}/flip/{seed}", "nvdb", "nvdb.read", dict(fmt=fmt, kind="flip", seed=seed),
                            ci=(fmt, "flip") in _CI and seed == 0))
        for seed in range(8):
            out.append(Case(f"nvdb/read/{fmt}/truncate/{seed}", "nvdb", "nvdb.read",
                            dict(fmt=fmt, kind="truncate", seed=seed), ci=(fmt, "truncate") in _CI and seed == 0))
        for kind in GRID_EDITS:
            out.append(Case(f"nvdb/read/{fmt}/{kind}", "nvdb", "nvdb.read", dict(fmt=fmt, kind=kind),
                            ci=(fmt, kind) in _CI))
        for kind in FILE_EDITS.get(fmt, ()):
            out.append(Case(f"nvdb/read/{fmt}/{kind}", "nvdb", "nvdb.read", dict(fmt=fmt, kind=kind),
                            ci=(fmt, kind) in _CI))
    for kind in ("zip_bomb_claim_2p40", "zip_bomb_claim_small"):
        out.append(Case(f"nvdb/read/zip/{kind}", "nvdb", "nvdb.read", dict(fmt="zip", kind=kind), ci=("zip", kind) in _CI,
                        timeout=120))
    for kind in ("empty", "random"):
        out.append(Case(f"nvdb/read/raw/{kind}", "nvdb", "nvdb.read", dict(fmt="raw", kind=kind)))
    for seed in range(16):
        out.append(Case(f"nvdb/kernel/flip/{seed}", "nvdb", "nvdb.kernel", dict(kind="flip", seed=seed), ci=seed == 0))
    for kind in GRID_EDITS:
        out.append(Case(f"nvdb/kernel/{kind}", "nvdb", "nvdb.kernel", dict(kind=kind), ci=kind == "leaf_offset_huge"))
    for seed in range(6):
        out.append(Case(f"nvdb/constant/flip/{seed}", "nvdb", "nvdb.constant", dict(kind="flip", seed=seed)))
    for kind in ("grid_size_max", "leaf_count_huge", "root_offset_huge", "voxel_size_nan", "grid_type_float"):
        out.append(Case(f"nvdb/constant/{kind}", "nvdb", "nvdb.constant", dict(kind=kind), ci=kind == "grid_size_max"))
    return out
