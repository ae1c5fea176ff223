"""Read and write ``.nvdb`` files: NanoVDB's segmented format (codec none or ZIP) and raw buffers.

A segmented file is a sequence of segments, each
``FileHeader{u64 magic, u32 version, u16 gridCount, u16 codec}``, then per grid
``FileMetaData`` (176 B) followed by the grid name (``nameSize`` bytes, NUL included), then the
grids themselves: raw for codec NONE, ``[u64 n][n bytes of zlib]`` for codec ZIP (NanoVDB's
``io::Internal::write``). A raw file (``GridHandle::write``) is just the grid buffer.

Reading follows NanoVDB's ``io::readGrids``: grid data is consumed sequentially rather than by
``FileMetaData::fileSize``, because writers disagree on it (warp stores the compressed size without
the 8-byte chunk header).

Every size a file claims (grid sizes, ZIP chunk sizes, name sizes) is checked against the bytes
that are really there, and what would be allocated against ``Limits.grid_bytes``, before anything
is allocated or inflated.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import numpy as np

from ..limits import DEFAULT, Limits
from . import layout as L
from .builder import concat_grids
from .layout import GridLimitError, NanoVDBError
from .nanovdb import NanoGrid, as_byte_buffer
from .nanovdb_read import read_grids

# zlib's deflate cannot expand data more than about 1032:1 (a stream of one repeated byte); a
# chunk that claims more is corrupt, and is refused before it is inflated
ZLIB_MAX_RATIO = 1032

PathOrBytes = str | os.PathLike | bytes | bytearray | memoryview | np.ndarray

CODECS = {"none": L.CODEC_NONE, "zip": L.CODEC_ZIP}


def string_hash(name: str) -> int:
    """Return NanoVDB's io::stringHash of name (the FileMetaData nameKey)."""
    h = 0
    for c in name.encode("utf-8"):
        overflow = h >> 56
        h = (h * 67 + c + overflow) & 0xFFFFFFFFFFFFFFFF
    return h


def _load(source: PathOrBytes, limits: Limits = DEFAULT) -> tuple[bytes, str]:
    """Return the bytes of source (a path or an in-memory buffer) and a name for error messages."""
    if isinstance(source, (str, os.PathLike)):
        where = f"file {os.fspath(source)!r}"
        try:
            size = os.stat(source).st_size
            if size > limits.grid_bytes:
                raise GridLimitError(
                    f"{where}: {size} bytes, more than the limit of {limits.grid_bytes} (luisaml.Limits.grid_bytes)"
                )
            return Path(source).read_bytes(), where
        except OSError as e:
            raise NanoVDBError(f"cannot read {where}: {e.strerror}") from e
    if isinstance(source, np.ndarray):
        return as_byte_buffer(source).tobytes(), "buffer"
    return bytes(source), "buffer"


def is_segmented(data: bytes) -> bool:
    """Return True when data starts with a .nvdb FileHeader rather than a raw grid."""
    if len(data) < L.FILE_HEADER_SIZE:
        return False
    magic, version, grid_count, codec = struct.unpack_from("<QIHH", data, 0)
    if magic == L.MAGIC_FILE:
        return True
    if magic != L.MAGIC_NUMB:
        return False
    # "NanoVDB0" starts both legacy files and 32.6 grids. A 32.6 grid carries "NanoVDB1" in mData2;
    # a file header has a compatible version right after the magic (a grid has its checksum there).
    if len(data) >= L.GRID_DATA_SIZE and struct.unpack_from("<Q", data, L.GRID_OFF_DATA2)[0] == L.MAGIC_GRID:
        return False
    return version >> 21 == L.ABI_MAJOR and grid_count > 0 and codec <= L.CODEC_BLOSC


def _read_segment(data: bytes, pos: int, where: str, limits: Limits = DEFAULT,
                  budget: int | None = None) -> tuple[list[bytes], int]:
    """Return the grid buffers of the segment at pos and the position after it; budget is what
    is left of Limits.grid_bytes for the grids of this file."""
    budget = limits.grid_bytes if budget is None else budget
    if len(data) - pos < L.FILE_HEADER_SIZE:
        raise NanoVDBError(f"{where}: truncated segment header at byte {pos}")
    magic, version, grid_count, codec = struct.unpack_from("<QIHH", data, pos)
    if magic not in L.FILE_MAGICS:
        raise NanoVDBError(
            f"{where}: segment at byte {pos} has magic {L.magic_name(magic)}, expected NanoVDB2 or NanoVDB0"
        )
    major, minor, patch = L.unpack_version(version)
    if major != L.ABI_MAJOR:
        raise NanoVDBError(
            f"{where}: segment at byte {pos} has version {major}.{minor}.{patch}, expected ABI {L.ABI_MAJOR}"
        )
    if codec not in (L.CODEC_NONE, L.CODEC_ZIP):
        raise NanoVDBError(
            f"{where}: segment at byte {pos} uses codec {L.CODEC_NAMES.get(codec, codec)}; "
            "only none (0) and zip (1) are supported"
        )
    pos += L.FILE_HEADER_SIZE
    sizes = []
    for i in range(grid_count):
        if len(data) - pos < L.FILE_METADATA_SIZE:
            raise NanoVDBError(f"{where}: truncated FileMetaData #{i} at byte {pos}")
        grid_size = struct.unpack_from("<Q", data, pos + L.FILE_META_OFF_GRID_SIZE)[0]
        name_size = struct.unpack_from("<I", data, pos + L.FILE_META_OFF_NAME_SIZE)[0]
        if grid_size < L.MIN_GRID_SIZE:
            raise NanoVDBError(
                f"{where}: FileMetaData #{i} at byte {pos} gives grid size {grid_size}, smaller than the "
                f"{L.MIN_GRID_SIZE} bytes of a grid's headers"
            )
        if grid_size > budget:
            raise GridLimitError(
                f"{where}: FileMetaData #{i} at byte {pos} gives grid size {grid_size}, "
                + (f"more than the limit of {limits.grid_bytes} bytes" if budget == limits.grid_bytes
                   else f"which with the grids before it exceeds the limit of {limits.grid_bytes} bytes")
                + " (luisaml.Limits.grid_bytes)"
            )
        budget -= grid_size
        pos += L.FILE_METADATA_SIZE + name_size
        if pos > len(data):
            raise NanoVDBError(f"{where}: grid name #{i} ({name_size} bytes) runs past the end of the file")
        sizes.append(grid_size)
    grids = []
    for i, grid_size in enumerate(sizes):
        if codec == L.CODEC_NONE:
            if len(data) - pos < grid_size:
                raise NanoVDBError(
                    f"{where}: truncated: grid #{i} needs {grid_size} bytes at byte {pos}, {len(data) - pos} remain"
                )
            grids.append(data[pos : pos + grid_size])
            pos += grid_size
            continue
        if len(data) - pos < 8:
            raise NanoVDBError(f"{where}: truncated ZIP chunk header of grid #{i} at byte {pos}")
        n = struct.unpack_from("<Q", data, pos)[0]
        pos += 8
        if len(data) - pos < n:
            raise NanoVDBError(
                f"{where}: truncated: ZIP chunk of grid #{i} has {n} bytes, {len(data) - pos} remain"
            )
        if grid_size > ZLIB_MAX_RATIO * n + 1024:
            raise NanoVDBError(
                f"{where}: FileMetaData gives grid #{i} {grid_size} bytes, more than its {n}-byte ZIP chunk "
                f"can inflate to (zlib expands at most {ZLIB_MAX_RATIO}:1)"
            )
        # Bounded: a corrupt or hostile chunk cannot inflate past the size the metadata declares.
        inflater = zlib.decompressobj()
        try:
            raw = inflater.decompress(data[pos : pos + n], grid_size + 1)
        except zlib.error as exc:
            raise NanoVDBError(f"{where}: grid #{i} ZIP data is corrupt: {exc}") from exc
        if len(raw) > grid_size:
            raise NanoVDBError(
                f"{where}: grid #{i} decompresses to more than the {grid_size} bytes FileMetaData says"
            )
        if not inflater.eof:
            raise NanoVDBError(f"{where}: grid #{i} ZIP data is corrupt: the stream ends early")
        if len(raw) != grid_size:
            raise NanoVDBError(
                f"{where}: grid #{i} decompresses to {len(raw)} bytes, FileMetaData says {grid_size}"
            )
        grids.append(raw)
        pos += n
    return grids, pos


def read_nvdb_buffer(source: PathOrBytes, *, limits: Limits = DEFAULT) -> bytes:
    """Return the raw grid buffer (all grids back to back, renumbered) of a .nvdb file or raw buffer."""
    data, where = _load(source, limits)
    if not data:
        raise NanoVDBError(f"{where}: empty")
    if not is_segmented(data):
        return data
    parts: list[bytes] = []
    pos = 0
    budget = limits.grid_bytes
    while pos < len(data):
        grids, pos = _read_segment(data, pos, where, limits, budget)
        parts.extend(grids)
        budget -= sum(len(g) for g in grids)
    if not parts:
        raise NanoVDBError(f"{where}: holds no grids")
    # concat_grids validates every grid and numbers them like NanoVDB's updateGridCount.
    return concat_grids(parts)


def read_nvdb(source: PathOrBytes, *, limits: Limits = DEFAULT) -> list[NanoGrid]:
    """Return the validated grids of a .nvdb file (segmented or raw) or an in-memory buffer."""
    return read_grids(read_nvdb_buffer(source, limits=limits), limits=limits)


def _file_metadata(grid: NanoGrid, file_size: int, codec: int) -> bytes:
    """Return the 176-byte FileMetaData of grid, filled like NanoVDB's FileGridMetaData."""
    name = grid.name.encode("utf-8")
    meta = bytearray(L.FILE_METADATA_SIZE)
    struct.pack_into(
        "<QQQQII",
        meta,
        0,
        grid.grid_size,
        file_size,
        string_hash(grid.name),
        grid.voxel_count,
        grid.grid_type,
        grid.grid_class,
    )
    struct.pack_into("<6d", meta, L.FILE_META_OFF_WORLD_BBOX, *grid.world_bbox.reshape(-1).tolist())
    struct.pack_into("<6i", meta, L.FILE_META_OFF_INDEX_BBOX, *grid.root_bbox.reshape(-1).tolist())
    struct.pack_into("<3d", meta, L.FILE_META_OFF_VOXEL_SIZE, *grid.voxel_size.tolist())
    struct.pack_into("<I", meta, L.FILE_META_OFF_NAME_SIZE, len(name) + 1)
    struct.pack_into("<4I", meta, L.FILE_META_OFF_NODE_COUNT, *grid.tree.node_counts, 1)
    struct.pack_into("<3I", meta, L.FILE_META_OFF_TILE_COUNT, *grid.tree.tile_counts)
    struct.pack_into("<HHI", meta, L.FILE_META_OFF_CODEC, codec, 0, L.pack_version(*grid.version))
    return bytes(meta) + name + b"\0"


GridsLike = bytes | np.ndarray | NanoGrid | list[bytes | np.ndarray | NanoGrid]


def _grid_list(grids: GridsLike) -> list[NanoGrid]:
    """Return the parsed grids of a raw buffer, a NanoGrid, or a list of either."""
    items = grids if isinstance(grids, list) else [grids]
    return [g for item in items for g in ([item] if isinstance(item, NanoGrid) else read_grids(item))]


def encode_nvdb(grids: GridsLike, codec: str = "none") -> bytes:
    """Return the bytes of a one-segment .nvdb file holding the given grids (codec "none" or "zip")."""
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {sorted(CODECS)}, got {codec!r}")
    c = CODECS[codec]
    parsed = _grid_list(grids)
    if not parsed:
        raise NanoVDBError("cannot write a .nvdb file without grids")
    if len(parsed) > 0xFFFF:
        raise NanoVDBError(f"a segment holds at most 65535 grids, got {len(parsed)}")
    payloads = []
    for g in parsed:
        raw = g.data()
        payloads.append(raw if c == L.CODEC_NONE else _zip_chunk(raw))
    header = struct.pack("<QIHH", L.MAGIC_FILE, L.pack_version(*parsed[0].version), len(parsed), c)
    metas = [_file_metadata(g, len(p), c) for g, p in zip(parsed, payloads)]
    return header + b"".join(metas) + b"".join(payloads)


def _zip_chunk(raw: bytes) -> bytes:
    comp = zlib.compress(raw)
    return struct.pack("<Q", len(comp)) + comp


def write_nvdb(path: str | os.PathLike, grids: GridsLike, codec: str = "none") -> Path:
    """Write grids to path as a .nvdb file (codec "none" or "zip"); return the path."""
    out = Path(path)
    out.write_bytes(encode_nvdb(grids, codec))
    return out


def write_raw(path: str | os.PathLike, grids: GridsLike) -> Path:
    """Write grids to path as a raw grid buffer, renumbered (what GridHandle::write does); return the path."""
    data = concat_grids(_grid_list(grids))
    out = Path(path)
    out.write_bytes(data)
    return out
