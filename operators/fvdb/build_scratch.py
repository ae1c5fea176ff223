"""The int scratch of a grid built on the device (operators/fvdb/topology.py's DeviceGridBuild,
topology_device.py): its regions' word offsets, the layout table at its start that the stages read
them from, and the levels of its prefix sums."""
from __future__ import annotations

from luisaml.fvdb.builder import HEADER_SIZE
from luisaml.shaders import grid_layout as G


def scan_levels(size: int) -> list[int]:
    """Return the word counts of a prefix sum's levels: size, then one word per SCAN-word chunk, up
    to a level that fits one chunk."""
    out = [max(int(size), 0)]
    while out[-1] > G.SCAN:
        out.append(-(-out[-1] // G.SCAN))
    return out


class ScratchWord:
    """A region's base (or a size) that the stages read from the layout table at the scratch's start
    (word `at`) instead of holding it as a literal: the kernels are then the same text for every
    network of the op (the CUDA backend compiles each distinct kernel once, about a second cold)."""

    def __init__(self, at: int, value: int):
        self.at, self.value = at, int(value)

    def __str__(self) -> str:
        return f"scratch_int.read({self.at})"

    def __format__(self, spec: str) -> str:
        return str(self)

    def __add__(self, other) -> str:
        return f"({self} + {other})"

    def __radd__(self, other) -> str:
        return f"({other} + {self})"


class Scratch:
    """Word offsets of a device grid build's int scratch, for N voxel keys of B grids (upper bounds:
    N leaves, N lower and N upper nodes). Words 0..TABLE hold the layout table (the clear stage writes
    it); ctr and the summaries sit at fixed words after it; every other base is a ScratchWord."""

    TABLE = 96  # regions from word 0, each prefix sum's levels from word 32 + 8 * its number
    LEVELS = 32
    CTR = TABLE  # fixed: the same in every network
    SUMMARY = CTR + G.C_WORDS  # right after ctr: one read-back takes both

    def __init__(self, n: int, grids: int):
        self.words = self.SUMMARY + G.S_WORDS * grids
        self.n, self.grids = n, grids
        self.ctr, self.summary = self.CTR, self.SUMMARY
        self.table: list[int] = []  # word k of the layout table
        cap = 2
        while cap < 2 * n:
            cap *= 2
        self.raw = {"keys": n, "grids": grids, "cap": cap}
        self.chunks = max(-(-n // G.CHUNK), 1)
        hist = 256 * self.chunks
        # Regions by when the stages use them (topology.py's phases), so that those never live at once share
        # words: `sorting` from the leaf stage through the last radix pass; `hashing` from the keys to the leaf
        # stage, before the sort (so the radix passes' second histogram buffer, hist2, lives there: a pass's
        # scatter counts the next pass's digits into the buffer its own did not use); `ranked` from the rank
        # stage on, after the sort (the nodes' boxes too: the rank stage starts them empty), over both; the
        # rest through the whole build. About 58 words a key where each its own were 78.
        sorting = {"key2": G.KEY_WORDS * n, "hist": hist + 1}
        hashing = {"vox": 4 * n, "owner": cap, "slot": n, "ids": n + 1}
        ranked = {"skey": 4 * n, "counts": n + 1, "new_lower": n + 1, "new_upper": n + 1, "leaf_box": 6 * n,
                  "lower_first": n + 1, "upper_first": n + 1, "upper_lower": n + 1, "lower_box": 6 * n,
                  "upper_box": 6 * n}
        base = self.words
        after_hashing = self._place(hashing, self._place(sorting, base))
        after_hist2 = self._place({"hist2": hist}, self.raw["vox"])
        self.words = max(after_hashing, after_hist2, self._place(ranked, base))
        whole = {"lkey": 4 * n, "mask": 16 * n, "order_a": n, "order_b": n,
                 "grid_first": 2 * grids, "grid_box": 6 * grids,
                 "layout": 16 + G.G_WORDS * grids,  # word 0: the blob's words, 1: all voxels; rows from 16
                 "headers": (HEADER_SIZE // 4) * grids}
        for name, size in whole.items():
            self.raw[name] = self.take(size)
        for name, value in self.raw.items():
            setattr(self, name, self.word(value))
        self.order = (self.order_a, self.order_b)
        assert len(self.table) <= self.LEVELS, len(self.table)
        self.table += [0] * (self.TABLE - len(self.table))
        self.aux: dict[str, list] = {}
        for j, (name, size) in enumerate((("ids", n), ("hist", 256 * self.chunks), ("counts", n), ("new_lower", n),
                                          ("new_upper", n))):  # the prefix sums' upper levels, at fixed words
            levels = scan_levels(size)[1:]
            assert len(levels) < 8, levels  # (32^8 words: beyond 32-bit indexing)
            self.aux[name] = [getattr(self, name)] + [self.word(self.take(m), self.LEVELS + 8 * j + k)
                                                      for k, m in enumerate(levels)]

    def word(self, value: int, at: int | None = None) -> ScratchWord:
        if at is None:
            at = len(self.table)
            self.table.append(0)
        self.table[at] = int(value)
        return ScratchWord(at, value)

    def _place(self, sizes: dict, base: int) -> int:
        """Place the regions `sizes` one after another from word `base` (raw); return the word after them."""
        for name, size in sizes.items():
            self.raw[name] = base
            base += max(int(size), 1)
        return base

    def take(self, words: int) -> int:
        base = self.words
        self.words += max(int(words), 1)
        return base

    def levels_at(self, name: str) -> int:
        """The table word of the base of level 1 of the prefix sum over region `name` (level j's at this
        + j - 1; a word past the sum's top level holds 0)."""
        return self.LEVELS + 8 * list(self.aux).index(name)

    def levels(self, name: str) -> list:
        """Return the bases (ScratchWord) of the levels of the prefix sum over region `name`."""
        return self.aux[name]
