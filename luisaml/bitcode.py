"""LuisaCompute's cached kernels as files: whether an LLVM bitcode file is complete, and the scan
that removes the incomplete ones from a kernel cache folder (LuisaCompute exits the process on a
truncated cached kernel; luisaml/cache.py runs the scan before a process's first kernel build)."""
from __future__ import annotations

import json
import os
import shutil
import struct
import time
from pathlib import Path

from .log import logger

MANIFEST = ".luisaml-checked.json"  # name -> [size, mtime_ns] of kernel files found complete
# an incomplete file whose size still changes over this long is being written by another process
_SETTLE_S = 0.05


def scan_kernels(d: Path) -> list[str]:
    """Delete every kernel_*.bc in d that is not complete LLVM bitcode, with its .hash; return
    their names. Files found complete are remembered (name, size, mtime) in a manifest in d."""
    manifest_path = d / MANIFEST
    try:
        known = json.loads(manifest_path.read_text())
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    good: dict[str, list[int]] = {}
    bad: list[str] = []
    with os.scandir(d) as it:
        for e in it:
            if not (e.name.startswith("kernel_") and e.name.endswith(".bc")):
                continue
            if e.is_dir(follow_symlinks=False):  # LuisaCompute aborts on a folder where a kernel belongs
                shutil.rmtree(e.path, ignore_errors=True)
                Path(e.path[:-3] + ".hash").unlink(missing_ok=True)
                bad.append(e.name)
                continue
            try:
                st = e.stat()
            except FileNotFoundError:
                continue
            stamp = [st.st_size, st.st_mtime_ns]
            if known.get(e.name) == stamp:
                good[e.name] = stamp
                continue
            try:
                problem = bitcode_problem(e.path)
            except OSError as err:
                problem = f"unreadable ({err.strerror})"
            if problem is None:
                good[e.name] = stamp
                continue
            time.sleep(_SETTLE_S)
            try:
                if os.stat(e.path).st_size != st.st_size:
                    continue  # still growing: another process is writing it
            except FileNotFoundError:
                continue
            logger.debug("kernel cache: %s: %s", e.name, problem)
            for p in (Path(e.path), Path(e.path[:-3] + ".hash")):
                try:
                    p.unlink(missing_ok=True)
                except IsADirectoryError:
                    shutil.rmtree(p, ignore_errors=True)
            bad.append(e.name)
    if good != known:
        tmp = d / f"{MANIFEST}.{os.getpid()}.tmp"
        try:
            tmp.write_text(json.dumps(good, separators=(",", ":")))
            os.replace(tmp, manifest_path)
        except OSError:
            tmp.unlink(missing_ok=True)
    return bad


# LLVM bitcode: https://llvm.org/docs/BitCodeFormat.html
_WRAPPER_MAGIC = 0x0B17C0DE
_RAW_MAGIC = b"BC\xc0\xde"
_MODULE_BLOCK, _STRTAB_BLOCK = 8, 23


def bitcode_problem(data: bytes | str | os.PathLike) -> str | None:
    """Return why `data` (bytes, or a file's path) is not a complete LLVM bitcode file, or None
    when it is.

    Cheap: only the top level is read. It is a sequence of blocks, each ENTER_SUBBLOCK (abbrev id 1
    in 2 bits), a vbr8 block id, a vbr4 abbrev width, 32-bit alignment, and a 32-bit count of the
    words that follow; every block must end inside the file, the last at its end (zero padding
    allowed), and a module must be followed by its string table (module version 2, LLVM >= 5), so
    that a cut between two blocks is caught too."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return _walk(bytes(data).__getitem__, len(data))
    with open(data, "rb") as f:
        size = os.fstat(f.fileno()).st_size

        def read(s: slice) -> bytes:
            f.seek(s.start)
            return f.read(s.stop - s.start)

        return _walk(read, size)


def _walk(read, size: int) -> str | None:
    """bitcode_problem over read(slice) -> bytes of a file of `size` bytes."""
    if size == 0:
        return "empty"
    base, end = 0, size
    head = read(slice(0, 20))
    if len(head) >= 4 and struct.unpack_from("<I", head)[0] == _WRAPPER_MAGIC:
        if len(head) < 20:
            return "truncated wrapper header"
        _, offset, length = struct.unpack_from("<3I", head, 4)
        if offset + length > size:
            return f"the wrapper declares {offset + length} bytes, the file has {size}"
        base, end = offset, offset + length
        head = read(slice(base, base + 4))
    if head[:4] != _RAW_MAGIC:
        return "not LLVM bitcode (no 'BC' 0xC0DE magic)"
    pos = base + 4
    blocks: list[int] = []
    module_version = None
    while pos < end:
        chunk = read(slice(pos, min(pos + 24, end)))
        if not any(chunk) and end - pos <= 4096 and not any(read(slice(pos, end))):
            break  # zero padding to the end
        r = _Bits(chunk, 0, len(chunk))
        try:
            if r.read(2) != 1:
                return f"byte {pos}: a top-level entry that is not a block"
            block_id = r.vbr(8)
            width = r.vbr(4)
            r.align32()
            words = r.read(32)
        except EOFError:
            return f"byte {pos}: truncated block header"
        body = pos + r.bit // 8
        block_end = body + 4 * words
        if block_end > end:
            return f"block {block_id} at byte {pos} declares {block_end - pos} bytes, {end - pos} are left"
        if block_id == _MODULE_BLOCK:
            module_version = _module_version(read(slice(body, min(body + 16, block_end))), width)
        blocks.append(block_id)
        pos = block_end
    if _MODULE_BLOCK not in blocks:
        return "no module block"
    if (module_version is None or module_version >= 2) and _STRTAB_BLOCK not in blocks[blocks.index(_MODULE_BLOCK):]:
        return "no string table after the module (cut between two blocks)"
    return None


def _module_version(data: bytes, width: int) -> int | None:
    """The module block's first record, when it is the unabbreviated VERSION record LLVM writes."""
    r = _Bits(data, 0, len(data))
    try:
        if r.read(width) != 3:  # UNABBREV_RECORD
            return None
        code, nops = r.vbr(6), r.vbr(6)
        return r.vbr(6) if code == 1 and nops >= 1 else None
    except EOFError:
        return None


class _Bits:
    """Little-endian bit reader over data[start:end] (bitcode fields are packed from bit 0 up)."""

    def __init__(self, data: bytes, start: int, end: int):
        self.data, self.bit, self.end = data, start * 8, end * 8

    def read(self, n: int) -> int:
        if self.bit + n > self.end:
            raise EOFError
        first, last = self.bit // 8, (self.bit + n + 7) // 8
        v = int.from_bytes(self.data[first:last], "little") >> (self.bit % 8)
        self.bit += n
        return v & ((1 << n) - 1)

    def vbr(self, n: int) -> int:
        hi = 1 << (n - 1)
        v, shift = 0, 0
        while True:
            chunk = self.read(n)
            v |= (chunk & (hi - 1)) << shift
            if not chunk & hi:
                return v
            shift += n - 1
            if shift > 64:
                raise EOFError

    def align32(self) -> None:
        self.bit = (self.bit + 31) // 32 * 32
