"""A dependency-free PNG writer for images computed by kernels."""
from __future__ import annotations

import struct
import zlib

import numpy as np


def encode_png(image: np.ndarray) -> bytes:
    """Return PNG bytes of an H x W (grey), H x W x 3 or H x W x 4 image; floats are clipped to [0, 1]."""
    a = np.asarray(image)
    if a.dtype != np.uint8:
        a = (np.clip(a, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    if a.ndim == 2:
        a = a[:, :, None]
    h, w, c = a.shape
    kind = {1: 0, 3: 2, 4: 6}[c]
    rows = b"".join(b"\0" + a[y].tobytes() for y in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", w, h, 8, kind, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")


def write_png(path: str, image: np.ndarray) -> None:
    """Write an image as PNG."""
    with open(path, "wb") as f:
        f.write(encode_png(image))
