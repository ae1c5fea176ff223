"""Read and validate NanoVDB OnIndex grids held in a byte buffer (pure numpy).

A buffer holds one or more grids back to back (each starts at the previous one's offset plus its
``mGridSize``). :func:`read_grids` parses and validates every grid before anything else touches it:
every offset and count that a later traversal follows is checked against the buffer, so a bad blob
fails here with a :class:`NanoVDBError` naming the field, the expected and the actual value, and
never as an out-of-bounds read later (on the host or in a shader that trusts the same bytes).
A new grid is checked each time a bundle is bound, so the checks are vectorised per node level: a
level (all leaves, all lower nodes, ...) is one [nodes, bytes] view of the buffer
(nanovdb.records), its fields strided views of that, its masks uint64 words, and each check one
array expression over the level; no Python loop runs per node.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ..limits import DEFAULT, Limits
from . import layout as L
from .layout import GridLimitError, NanoVDBError
from .nanovdb import (I32, I64, ROW_SUM, U32, U64, GridMap, NanoGrid, TreeInfo, as_byte_buffer, key_to_origin,
                      popcount64, record_field, records, set_bits, slot_offsets)

# Bits a root key can have: u32(coord) >> 12 is 20 bits, placed at bit 0 (k), 21 (j) and 42 (i).
_KEY_BITS = 0xFFFFF | (0xFFFFF << 21) | (0xFFFFF << 42)
# Times _PREFIX_WEIGHTS, a leaf's per-word popcounts (int64 [N, 8]) give its expected prefix-sum word: word w's count
# belongs to every running total f >= w (f < 7), each a 9-bit field at bit 9f.
_PREFIX_WEIGHTS = np.array([sum(1 << (9 * f) for f in range(w, 7)) for w in range(8)], np.int64)
_PREFIX_BITS = (1 << 63) - 1  # the seven fields


def _fail(where: str, what: str) -> NanoVDBError:
    return NanoVDBError(f"{where}: {what}")


def _c_string(raw: np.ndarray, where: str, what: str) -> str:
    """Return the NUL-terminated string in raw, or raise if it has no NUL."""
    data = raw.tobytes()
    end = data.find(b"\0")
    if end < 0:
        raise _fail(where, f"{what} is not NUL-terminated within its {len(data)} bytes")
    return data[:end].decode("utf-8", errors="replace")


def _check_range(where: str, what: str, begin: int, count: int, stride: int, lo: int, hi: int) -> None:
    """Raise unless [begin, begin + count*stride) lies in [lo, hi) and begin is 32-byte aligned."""
    if count == 0:
        return
    if begin % L.DATA_ALIGNMENT:
        raise _fail(
            where,
            f"{what} starts at byte {begin - lo} of the grid, which is not {L.DATA_ALIGNMENT}-byte aligned",
        )
    end = begin + count * stride
    if begin < lo or end > hi:
        raise _fail(
            where,
            f"{what} ({count} x {stride} B) spans grid bytes [{begin - lo}, {end - lo}), "
            f"outside the grid's {hi - lo} bytes",
        )


@dataclass(frozen=True)
class _Level:
    """One node level located in the buffer: node i starts at begin + i*stride."""

    name: str
    begin: int
    count: int
    stride: int


def _child_index(where: str, what: str, target: np.ndarray, level: _Level) -> np.ndarray:
    """Return indices of the nodes of level that absolute byte positions target point at, or raise."""
    rel = np.asarray(target, np.int64) - level.begin
    node, into = np.divmod(rel, level.stride)
    ok = (rel >= 0) & (into == 0) & (node < level.count)
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise _fail(
            where,
            f"{what} #{bad} points at buffer byte {int(target[bad])}, which is not the start of one of the "
            f"{level.count} {level.name} nodes (expected {level.begin} + n*{level.stride})",
        )
    return node


def _check_referenced_once(where: str, idx: np.ndarray, level: _Level) -> None:
    """Raise unless every node of level is referenced by exactly one parent entry."""
    counts = np.bincount(idx, minlength=level.count) if level.count else np.zeros(0, np.int64)
    if (counts > 1).any():
        raise _fail(
            where,
            f"{level.name} node {int(np.flatnonzero(counts > 1)[0])} is the child of more than one parent",
        )
    if (counts == 0).any():
        raise _fail(
            where,
            f"{level.name} node {int(np.flatnonzero(counts == 0)[0])} is not reachable from the root "
            f"({int((counts == 0).sum())} of {level.count} {level.name} nodes are orphans)",
        )


def _in_node_order(idx: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Return the rows of values (one per parent entry, entry j pointing at node idx[j]) in node order.

    idx must be a permutation of the level's nodes, which _check_referenced_once has checked: every
    node then gets exactly one row. (Taking rows through the inverse permutation is several times
    faster than numpy's row-wise scatter out[idx] = values.)
    """
    entry_of = np.empty_like(idx)
    entry_of[idx] = np.arange(len(idx))
    return np.take(values, entry_of, axis=0)


@dataclass(frozen=True)
class _Walk:
    """The tree as reached from the root."""

    leaf_origins: np.ndarray  # int32 [N0,3]
    leaf_counts: np.ndarray  # int64 [N0], active voxels per leaf
    active_tiles: int


def _internal_children(
    buf: np.ndarray,
    where: str,
    parent: _Level,
    child: _Level,
    off_value_mask: int,
    off_child_mask: int,
    off_table: int,
    table_count: int,
    value_count: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Validate one internal level; return (parent idx, slot, child idx) per child and the active tile count.

    The whole level is read as one [nodes, bytes] view: its masks as uint64 words, its table as
    uint64 entries. A set child bit's entry is a byte offset from the node to its child, checked in
    bulk against the child level; a set value bit without a child bit is an active tile whose entry
    is an index into the value array.
    """
    rows = records(buf, parent.begin, parent.count, parent.stride)
    n_words = table_count // 64
    child_mask = record_field(rows, off_child_mask, U64, n_words)
    value_mask = record_field(rows, off_value_mask, U64, n_words)
    table = record_field(rows, off_table, U64, table_count)
    p_idx, slot = set_bits(child_mask)
    node_pos = parent.begin + parent.stride * p_idx
    target = node_pos + table[p_idx, slot].view(I64)
    c_idx = _child_index(where, f"{parent.name} child-table entry", target, child)
    # An active tile's table value is an index into the value array; a lookup returns it.
    t_idx, t_slot = set_bits(value_mask & ~child_mask)
    if len(t_idx):
        tile_values = table[t_idx, t_slot]
        if (tile_values >= np.uint64(value_count)).any():
            bad = int(np.flatnonzero(tile_values >= np.uint64(value_count))[0])
            raise _fail(
                where,
                f"active {parent.name} tile (node {int(t_idx[bad])}, slot {int(t_slot[bad])}) has index "
                f"{int(tile_values[bad])}, expected < value count {value_count}",
            )
    return p_idx, slot, c_idx, len(t_idx)


def walk_tree(buf: np.ndarray, where: str, g: dict) -> _Walk:
    """Validate the tree of a grid whose headers are parsed into g; return its node origins."""
    grid_pos = g["offset"]
    tree_pos = grid_pos + L.GRID_DATA_SIZE
    off_leaf, off_lower, off_upper, off_root = g["node_offsets"]
    n_leaf, n_lower, n_upper = g["node_counts"]
    grid_type = g["grid_type"]
    value_count = g["value_count"]

    # Tree data ends where blind metadata starts (or at the grid end when there is none).
    tree_end = grid_pos + (g["blind_metadata_offset"] if g["blind_metadata_count"] else g["grid_size"])

    if off_root < L.TREE_DATA_SIZE:
        raise _fail(where, f"root node offset is {off_root}, expected >= {L.TREE_DATA_SIZE} (after TreeData)")
    root_pos = tree_pos + off_root
    _check_range(where, "RootData", root_pos, 1, L.ROOT_DATA_SIZE, grid_pos, tree_end)
    table_size = struct.unpack_from("<I", buf, root_pos + L.ROOT_OFF_TABLE_SIZE)[0]
    tiles_pos = root_pos + L.ROOT_DATA_SIZE
    if tiles_pos + table_size * L.ROOT_TILE_SIZE > tree_end:
        raise _fail(
            where,
            f"root table size {table_size} needs {table_size * L.ROOT_TILE_SIZE} B of tiles after RootData, "
            f"but only {max(tree_end - tiles_pos, 0)} B remain before the end of the tree",
        )
    occupied = tiles_pos + table_size * L.ROOT_TILE_SIZE

    levels = []
    for name, off, count, stride in (
        ("upper", off_upper, n_upper, L.UPPER_NODE_SIZE),
        ("lower", off_lower, n_lower, L.LOWER_NODE_SIZE),
        ("leaf", off_leaf, n_leaf, L.LEAF_NODE_SIZE),
    ):
        begin = tree_pos + off
        if count:
            if off < L.TREE_DATA_SIZE:
                raise _fail(where, f"{name} node offset is {off}, expected >= {L.TREE_DATA_SIZE}")
            _check_range(where, f"{name} node array", begin, count, stride, grid_pos, tree_end)
            # Levels are breadth-first: root tiles, then upper, lower, leaf nodes, never overlapping.
            if begin < occupied:
                raise _fail(
                    where,
                    f"{name} node array starts at grid byte {begin - grid_pos}, overlapping the previous level "
                    f"which ends at grid byte {occupied - grid_pos}",
                )
            occupied = begin + count * stride
        levels.append(_Level(name, begin, count, stride))
    upper, lower, leaf = levels

    # Root tiles: keys unique (NanoVDB scans linearly, a duplicate would be unreachable), children valid.
    tiles = records(buf, tiles_pos, table_size, L.ROOT_TILE_SIZE)
    keys = record_field(tiles, L.TILE_OFF_KEY, U64)[:, 0]
    child = record_field(tiles, L.TILE_OFF_CHILD, I64)[:, 0]
    state = record_field(tiles, L.TILE_OFF_STATE, U32)[:, 0]
    value = record_field(tiles, L.TILE_OFF_VALUE, U64)[:, 0]
    if len(np.unique(keys)) != len(keys):
        raise _fail(where, "root table holds duplicate tile keys")
    if (keys & ~np.uint64(_KEY_BITS)).any():
        bad = int(keys[np.flatnonzero(keys & ~np.uint64(_KEY_BITS))[0]])
        # No coordinate produces such a key, so its subtree could never be looked up.
        raise _fail(where, f"root tile key 0x{bad:016x} has bits outside its three 20-bit coordinate fields")
    has_child = child != 0
    u_idx = _child_index(where, "root tile child", root_pos + child[has_child], upper)
    _check_referenced_once(where, u_idx, upper)
    active_root_tiles = (~has_child) & (state != 0)
    if (value[active_root_tiles] >= np.uint64(value_count)).any():
        raise _fail(where, f"an active root tile has an index >= the value count {value_count}")
    upper_origins = _in_node_order(u_idx, key_to_origin(keys[has_child]))

    p2, s2, l_idx, tiles2 = _internal_children(
        buf,
        where,
        upper,
        lower,
        L.UPPER_OFF_VALUE_MASK,
        L.UPPER_OFF_CHILD_MASK,
        L.UPPER_OFF_TABLE,
        L.UPPER_TABLE_COUNT,
        value_count,
    )
    _check_referenced_once(where, l_idx, lower)
    lower_origins = _in_node_order(
        l_idx, np.take(upper_origins, p2, axis=0) + slot_offsets(s2, L.UPPER_LOG2DIM, L.LOWER_TOTAL_LOG2)
    )

    p1, s1, f_idx, tiles1 = _internal_children(
        buf,
        where,
        lower,
        leaf,
        L.LOWER_OFF_VALUE_MASK,
        L.LOWER_OFF_CHILD_MASK,
        L.LOWER_OFF_TABLE,
        L.LOWER_TABLE_COUNT,
        value_count,
    )
    _check_referenced_once(where, f_idx, leaf)
    leaf_origins = _in_node_order(
        f_idx, np.take(lower_origins, p1, axis=0) + slot_offsets(s1, L.LOWER_LOG2DIM, L.LEAF_TOTAL_LOG2)
    )

    leaf_counts = _check_leaves(buf, where, leaf, leaf_origins, grid_type, value_count)
    return _Walk(leaf_origins, leaf_counts, int(active_root_tiles.sum()) + tiles2 + tiles1)


def _check_leaves(
    buf: np.ndarray, where: str, leaf: _Level, origins: np.ndarray, grid_type: int, value_count: int
) -> np.ndarray:
    """Validate leaf bboxes, prefix sums and value offsets; return the active count per leaf."""
    if leaf.count == 0:
        return np.zeros(0, np.int64)
    rows = records(buf, leaf.begin, leaf.count, leaf.stride)
    bbox_min = record_field(rows, L.LEAF_OFF_BBOX_MIN, I32, 3)
    if (bbox_min & ~np.int32(7) != origins).any():
        bad = int(np.flatnonzero((bbox_min & ~np.int32(7) != origins).any(axis=1))[0])
        raise _fail(
            where,
            f"leaf {bad} has bbox min {bbox_min[bad].tolist()}, outside the 8^3 block at "
            f"{origins[bad].tolist()} where the tree places it",
        )
    words = record_field(rows, L.LEAF_OFF_VALUE_MASK, U64, 8)
    offsets = record_field(rows, L.LEAF_OFF_OFFSET, U64)[:, 0]
    word_counts = popcount64(words)
    counts = word_counts @ ROW_SUM
    if grid_type == L.GRID_TYPE_ON_INDEX:
        prefix = record_field(rows, L.LEAF_OFF_PREFIX_SUM, U64)[:, 0]
        # Field f of the prefix word (9 bits at 9f, f < 7) must be popcount(words[0..f]); those
        # running totals are at most 448 < 512, so packing them is exact and the check compares one
        # word per leaf. Bit 63 lies outside the seven fields and is not compared.
        expected_word = (word_counts @ _PREFIX_WEIGHTS).view(np.uint64)
        wrong = (prefix & np.uint64(_PREFIX_BITS)) != expected_word
        if wrong.any():
            bad = int(np.flatnonzero(wrong)[0])
            fields = [(int(prefix[bad]) >> (9 * f)) & 511 for f in range(7)]
            expected = np.cumsum(word_counts[bad, :7]).tolist()
            raise _fail(
                where,
                f"leaf {bad} prefix sums {fields} do not match its value mask popcounts {expected}",
            )
        used = counts
    else:  # ValueIndex leaves index all 512 values
        used = np.full(leaf.count, L.LEAF_VALUE_COUNT, np.int64)
    nonempty = used > 0
    if (offsets[nonempty] == 0).any():
        raise _fail(
            where,
            f"leaf {int(np.flatnonzero(nonempty & (offsets == 0))[0])} has value offset 0 (the background index)",
        )
    # offset + used > value_count, in exact uint64 arithmetic: a hostile offset near 2^64 must not
    # wrap, and float64 would round offsets above 2^53.
    used_u = used.astype(np.uint64)
    room = np.uint64(value_count) - np.minimum(used_u, np.uint64(value_count))  # value_count - used, >= 0
    past = (used_u > np.uint64(value_count)) | (offsets > room)
    if (past & nonempty).any():
        bad = int(np.flatnonzero(nonempty & past)[0])
        raise _fail(
            where,
            f"leaf {bad} indexes values [{int(offsets[bad])}, {int(offsets[bad]) + int(used[bad])}), "
            f"beyond the grid's value count {value_count}",
        )
    return counts


def _parse_headers(buf: np.ndarray, pos: int, where: str) -> dict:
    """Return the GridData and TreeData fields at pos after checking the header-level invariants."""
    avail = len(buf) - pos
    need = L.GRID_DATA_SIZE + L.TREE_DATA_SIZE
    if avail < need:
        raise _fail(
            where, f"truncated: GridData+TreeData need {need} bytes, only {avail} remain in the buffer"
        )
    if pos % L.DATA_ALIGNMENT:
        raise _fail(where, f"grid starts at byte {pos}, which is not {L.DATA_ALIGNMENT}-byte aligned")
    magic, _checksum, version, flags, grid_index, grid_count, grid_size = struct.unpack_from(
        "<QQIIIIQ", buf, pos
    )
    if magic not in L.GRID_MAGICS:
        hint = " (this is a .nvdb file header: read it with read_nvdb)" if magic == L.MAGIC_FILE else ""
        raise _fail(
            where, f"bad magic {L.magic_name(magic)} (0x{magic:016x}), expected NanoVDB1 or NanoVDB0{hint}"
        )
    major, minor, patch = L.unpack_version(version)
    if major != L.ABI_MAJOR:
        raise _fail(
            where, f"NanoVDB version {major}.{minor}.{patch} has ABI {major}, expected ABI {L.ABI_MAJOR}"
        )
    grid_class, grid_type = struct.unpack_from("<II", buf, pos + L.GRID_OFF_GRID_CLASS)
    if grid_type not in L.GRID_TYPE_NAMES:
        raise _fail(
            where,
            f"grid type is {grid_type}, expected OnIndex ({L.GRID_TYPE_ON_INDEX}) or Index ({L.GRID_TYPE_INDEX})",
        )
    if grid_class not in L.INDEX_GRID_CLASSES:
        raise _fail(
            where,
            f"grid class is {grid_class}, expected one valid for an index grid: "
            "Unknown (0), IndexGrid (8) or TensorGrid (9)",
        )
    if not flags & L.FLAG_IS_BREADTH_FIRST:
        raise _fail(
            where, f"flags 0x{flags:x} lack IsBreadthFirst (0x20); only breadth-first layouts are supported"
        )
    if grid_size < L.MIN_GRID_SIZE:
        raise _fail(
            where, f"grid size {grid_size} is smaller than the {L.MIN_GRID_SIZE} bytes of its headers"
        )
    if grid_size % L.DATA_ALIGNMENT:
        raise _fail(where, f"grid size {grid_size} is not a multiple of {L.DATA_ALIGNMENT}")
    if grid_size > avail:
        raise _fail(where, f"truncated: grid size is {grid_size} bytes but only {avail} remain in the buffer")

    name = _c_string(
        buf[pos + L.GRID_OFF_GRID_NAME : pos + L.GRID_OFF_GRID_NAME + L.GRID_NAME_SIZE], where, "grid name"
    )
    blind_off, blind_count = struct.unpack_from("<qI", buf, pos + L.GRID_OFF_BLIND_METADATA_OFFSET)
    value_count = struct.unpack_from("<Q", buf, pos + L.GRID_OFF_DATA1)[0]
    t = pos + L.GRID_DATA_SIZE
    node_offsets = struct.unpack_from("<4q", buf, t + L.TREE_OFF_NODE_OFFSET)
    node_counts = struct.unpack_from("<3I", buf, t + L.TREE_OFF_NODE_COUNT)
    tile_counts = struct.unpack_from("<3I", buf, t + L.TREE_OFF_TILE_COUNT)
    voxel_count = struct.unpack_from("<Q", buf, t + L.TREE_OFF_VOXEL_COUNT)[0]
    return dict(
        offset=pos,
        grid_size=grid_size,
        version=(major, minor, patch),
        flags=flags,
        grid_index=grid_index,
        grid_count=grid_count,
        name=name,
        grid_class=grid_class,
        grid_type=grid_type,
        blind_metadata_offset=blind_off,
        blind_metadata_count=blind_count,
        value_count=value_count,
        node_offsets=node_offsets,
        node_counts=node_counts,
        tile_counts=tile_counts,
        voxel_count=voxel_count,
    )


def _check_blind_metadata(buf: np.ndarray, where: str, g: dict) -> None:
    """Raise unless the blind metadata table and every payload it describes lie inside the grid."""
    count, off, size = g["blind_metadata_count"], g["blind_metadata_offset"], g["grid_size"]
    if count == 0:
        return
    if off < L.MIN_GRID_SIZE or off % L.DATA_ALIGNMENT:
        raise _fail(
            where,
            f"blind metadata offset {off} must be >= {L.MIN_GRID_SIZE} and {L.DATA_ALIGNMENT}-byte aligned",
        )
    if off + count * L.BLIND_METADATA_SIZE > size:
        raise _fail(where, f"{count} blind metadata records at grid byte {off} run past the grid size {size}")
    for i in range(count):
        rec = off + i * L.BLIND_METADATA_SIZE
        data_off, value_count, value_size = struct.unpack_from("<qQI", buf, g["offset"] + rec)
        start = rec + data_off
        nbytes = value_count * value_size
        if start < 0 or start > size or nbytes > size - start:
            raise _fail(
                where,
                f"blind data #{i} ({nbytes} B at grid byte {start}) lies outside the grid's {size} bytes",
            )
        name_pos = g["offset"] + rec + L.BLIND_OFF_NAME
        _c_string(buf[name_pos : name_pos + L.BLIND_NAME_SIZE], where, f"blind data #{i} name")


def _read_map(buf: np.ndarray, pos: int) -> GridMap:
    mat = np.array(struct.unpack_from("<9d", buf, pos + L.GRID_OFF_MAP_MATD)).reshape(3, 3)
    inv = np.array(struct.unpack_from("<9d", buf, pos + L.GRID_OFF_MAP_INVMATD)).reshape(3, 3)
    vec = np.array(struct.unpack_from("<3d", buf, pos + L.GRID_OFF_MAP_VECD))
    return GridMap(mat, inv, vec)


def read_grid(data: bytes | np.ndarray, offset: int = 0, where: str | None = None, *,
              limits: Limits = DEFAULT) -> NanoGrid:
    """Return the validated grid whose GridData starts at byte offset of data."""
    buf = as_byte_buffer(data)
    where = where or f"NanoVDB grid at byte {offset}"
    if not 0 <= offset < len(buf):
        raise _fail(where, f"offset {offset} is outside the {len(buf)}-byte buffer")
    g = _parse_headers(buf, offset, where)
    if g["grid_size"] > limits.grid_bytes:
        raise GridLimitError(
            f"{where}: grid size is {g['grid_size']} bytes, more than the limit of {limits.grid_bytes} "
            "(luisaml.Limits.grid_bytes)"
        )
    _check_blind_metadata(buf, where, g)
    walk = walk_tree(buf, where, g)
    pos = offset
    root_pos = pos + L.GRID_DATA_SIZE + g["node_offsets"][3]
    return NanoGrid(
        buffer=buf,
        offset=pos,
        grid_size=g["grid_size"],
        version=g["version"],
        flags=g["flags"],
        grid_index=g["grid_index"],
        grid_count=g["grid_count"],
        name=g["name"],
        grid_class=g["grid_class"],
        grid_type=g["grid_type"],
        map=_read_map(buf, pos),
        voxel_size=np.array(struct.unpack_from("<3d", buf, pos + L.GRID_OFF_VOXEL_SIZE)),
        world_bbox=np.array(struct.unpack_from("<6d", buf, pos + L.GRID_OFF_WORLD_BBOX)).reshape(2, 3),
        blind_metadata_offset=g["blind_metadata_offset"],
        blind_metadata_count=g["blind_metadata_count"],
        value_count=g["value_count"],
        tree=TreeInfo(g["node_offsets"], g["node_counts"], g["tile_counts"], g["voxel_count"]),
        root_bbox=np.array(struct.unpack_from("<6i", buf, root_pos + L.ROOT_OFF_BBOX), np.int32).reshape(
            2, 3
        ),
        root_tile_count=struct.unpack_from("<I", buf, root_pos + L.ROOT_OFF_TABLE_SIZE)[0],
        leaf_voxel_count=int(walk.leaf_counts.sum()),
        active_tile_count=walk.active_tiles,
    )


def read_grids(data: bytes | np.ndarray, *, limits: Limits = DEFAULT) -> list[NanoGrid]:
    """Return every grid of a raw buffer of back-to-back grids (one or more), each validated."""
    return _each_grid(data, lambda buf, pos, k: read_grid(buf, pos, where=f"NanoVDB grid #{k} at byte {pos}",
                                                          limits=limits))


def _each_grid(data: bytes | np.ndarray, read_one) -> list[NanoGrid]:
    """Return read_one(buffer, byte offset, index) of each grid of a buffer of back-to-back grids."""
    buf = as_byte_buffer(data)
    if len(buf) == 0:
        raise NanoVDBError("empty buffer: expected at least one NanoVDB grid")
    grids: list[NanoGrid] = []
    pos = 0
    # Walk mGridSize to the end of the buffer, like GridHandle and warp's validator; mGridIndex and
    # mGridCount are not trusted because naive concatenation leaves them at 0 / 1 in every grid.
    while pos < len(buf):
        grids.append(read_one(buf, pos, len(grids)))
        pos += grids[-1].grid_size
    return grids


def read_built_grids(data: np.ndarray, *, limits: Limits = DEFAULT) -> list[NanoGrid]:
    """Return every grid of a buffer that luisaml's own builder wrote (on the host or the device),
    its headers parsed and checked but its tree not walked: the builder writes leaf voxels only,
    indexed 1..N, so the counts a walk would make are the header's. Never for bytes from outside
    (a bound grid, a file): those go through read_grids."""

    def read_one(buf, pos: int, k: int) -> NanoGrid:
        where = f"NanoVDB grid #{k} at byte {pos} (built by luisaml)"
        g = _parse_headers(buf, pos, where)
        if g["grid_size"] > limits.grid_bytes:
            raise GridLimitError(f"{where}: grid size is {g['grid_size']} bytes, more than the limit of "
                                 f"{limits.grid_bytes} (luisaml.Limits.grid_bytes)")
        root_pos = pos + L.GRID_DATA_SIZE + g["node_offsets"][3]
        # (the root's table size read below and the node ranges the kernels follow lie in the grid)
        _check_range(where, "RootData", root_pos, 1, L.ROOT_DATA_SIZE, pos, pos + g["grid_size"])
        return NanoGrid(
            buffer=buf, offset=pos, grid_size=g["grid_size"], version=g["version"], flags=g["flags"],
            grid_index=g["grid_index"], grid_count=g["grid_count"], name=g["name"], grid_class=g["grid_class"],
            grid_type=g["grid_type"], map=_read_map(buf, pos),
            voxel_size=np.array(struct.unpack_from("<3d", buf, pos + L.GRID_OFF_VOXEL_SIZE)),
            world_bbox=np.array(struct.unpack_from("<6d", buf, pos + L.GRID_OFF_WORLD_BBOX)).reshape(2, 3),
            blind_metadata_offset=g["blind_metadata_offset"], blind_metadata_count=g["blind_metadata_count"],
            value_count=g["value_count"],
            tree=TreeInfo(g["node_offsets"], g["node_counts"], g["tile_counts"], g["voxel_count"]),
            root_bbox=np.array(struct.unpack_from("<6i", buf, root_pos + L.ROOT_OFF_BBOX), np.int32).reshape(2, 3),
            root_tile_count=struct.unpack_from("<I", buf, root_pos + L.ROOT_OFF_TABLE_SIZE)[0],
            leaf_voxel_count=g["voxel_count"], active_tile_count=0)

    return _each_grid(data, read_one)
