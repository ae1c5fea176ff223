"""Where a device grid build's grids go in its blob, and who writes their headers (DeviceGridBuild's
last phases, operators/fvdb/topology.py): the one-thread layout stage that lays the grids out on the
device and the header each grid's thread writes, or the host's step over the grid summaries.

Two forms, chosen by `GridLayout.LAYOUT_ON_DEVICE` (kept for an A/B on a GPU):
- **on the device** (True): a "grid layout" phase, one thread (shaders/grid_write.py gb_layout; up to
  ONE_THREAD_SUMMARIES grids it writes their summary rows first, in the same stage), lays
  the grids out back to back from the summaries in int32 (an offset past INT32_MAX: ERR_BYTES, the
  blob left empty), writes the rows the write stages read, the blob's bytes (a counted total naming
  output 0, first capacity a lower bound of the grids' bytes) and whether they fit the blob's
  capacity (a room word: past it the write stages write nothing and the run is repeated with room,
  never cut); the leaves' count is output 4's counted total. In the last stage thread b < B writes
  grid b's 832-byte header (`emit_header`, grid_write.gb_write_header): the integer fields from the
  summary and layout rows, the map from the transforms row the host derived from h and o when they
  were bound (topology.grid_transforms: its floats and doubles, 1/h among them, as numpy makes them),
  and the world bbox, numpy's doubles fl(fl(i * h) + o), through shaders/f64.py's binary64 on 64-bit
  words (the DSL has no double). Every byte of the blob is written on the device. What remains at the
  end is an end-of-run HostRead (luisaml/dynamic.py, `at_end`) of the 16 counter words, in the run's
  one wait, whose step raises what the device flagged (`_end_step`: bad offsets or coordinates, 2 GiB,
  the summaries' leaves against the hash's) and patches nothing. One host synchronisation a build.
- **by the host mid-run** (False): the summaries read back between the summaries and the write phases
  (a HostRead), `_host_step` lays the grids out, sizes the blob and the leaves, and uploads the rows
  and the headers, which a "grid headers" phase copies into the blob. Two synchronisations a build.

The host's form runs `_lay_out` (the host's arithmetic, its errors: what the device flagged, the
summaries' leaves against the hash's, the 2 GiB limit); both forms' bytes equal the host builder's
(tests/fvdb/test_topology_device.py, test_build_layout.py, which also checks the device's headers
against builder.grid_header at awkward voxel sizes and origins).
"""
from __future__ import annotations

import struct

import numpy as np

from luisaml.dynamic import HostRead, HostResult, Phase, ScratchTotal
from luisaml.fvdb import layout as L
from luisaml.fvdb.builder import HEADER_SIZE, grid_header, grid_layout
from luisaml.shaders import grid_layout as G

INT32_MAX = 2**31 - 1
ONE_VOXEL_BYTES = grid_layout(1, 1, 1)[4]  # a grid of one voxel: the least a non-empty grid takes (305,216)


class GridLayout:
    """DeviceGridBuild's layout phases and host steps (a mixin: it reads the build's scratch S, its
    grid count B, node, outputs, and its _call / _emit_zero / _emit_blob_call)."""

    LAYOUT_ON_DEVICE = True  # False: the host lays the grids out mid-run (module docstring)
    # on the device's layout, up to this many grids: their summaries written by the layout's one thread
    # before it lays them out (one stage, not two); more: a thread a grid, then the layout (gb_layout's loop
    # over the grids is already sequential; a summary adds ~20 words of reads and writes a grid to it)
    ONE_THREAD_SUMMARIES = 16
    HEADER_WORDS = HEADER_SIZE // 4

    def who(self) -> str:
        """The node its run's errors name: "node 'name' (Domain::OpType)" as the user's model has it."""
        return self.node.describe()

    @property
    def layout_said(self) -> str:
        """The layout's part of the build's description."""
        return "layout and headers" if self.LAYOUT_ON_DEVICE else "host read-back of the layout"

    def layout_phases(self, summaries) -> list[Phase]:
        """The phases from the grid summaries (emit: `summaries`) to the zeroed blob, in this form."""
        S, B = self.S, self.B
        words = G.C_WORDS + G.S_WORDS * B  # (ctr and the summaries: one read, Scratch.SUMMARY follows CTR)
        if not self.LAYOUT_ON_DEVICE:
            return [Phase("grid summaries", B, summaries, readback=HostRead(S.ctr, words, self._host_step)),
                    Phase("zero the blob", self.ZERO_THREADS, self._emit_zero),
                    Phase("grid headers", self.HEADER_WORDS * B, lambda ctx, t: self._emit_blob_call(
                        ctx, "gb_header_word", S.layout + G.H_ROWS, S.headers, S.grids, t))]
        leaves = ScratchTotal(S.ctr + G.C_LEAVES, output=4)
        blob = ScratchTotal(S.layout.value + G.H_BYTES, output=0, first=B * ONE_VOXEL_BYTES)
        if B <= self.ONE_THREAD_SUMMARIES:  # (the layout's one thread writes the few summaries first: a launch fewer)
            def both(ctx, t):
                with ctx.loop(B, "b") as b:
                    summaries(ctx, b)
                self._emit_layout(ctx, t)
            # (the leaves' total copied after this stage, the blob's bytes after the next: the same words, in
            # the order the counted outputs had)
            return [Phase("grid summaries and layout", 1, both, readback=leaves),
                    Phase("zero the blob", self.ZERO_THREADS, self._emit_zero, readback=blob)]
        return [Phase("grid summaries", B, summaries, readback=leaves),
                Phase("grid layout", 1, self._emit_layout, readback=blob),
                Phase("zero the blob", self.ZERO_THREADS, self._emit_zero)]

    def end_read(self) -> HostRead | None:
        """The last phase's read-back, on the device's layout: the counters, for the errors the device
        flagged (raised at the run's end; nothing patched)."""
        if not self.LAYOUT_ON_DEVICE:
            return None
        return HostRead(self.S.ctr, G.C_WORDS, self._end_step, at_end=True)

    def emit_header(self, ctx, b) -> None:
        """In the last stage, thread b < B: grid b's header (on the device's layout; the host's copies
        the uploaded headers in its own phase), where the blob had room."""
        if not self.LAYOUT_ON_DEVICE:
            return
        self._emit_blob_call(ctx, "gb_write_header", self.S.layout + G.H_ROWS, self.S.summary, b, self.B)

    def room_guard(self, ctx) -> None:
        """Open the block of a write stage's blob writes: on the device's layout, only where the blob had
        room (gb_layout's H_ROOM word); the caller indents under it."""
        ctx.line(f"if scratch_int.read({self.S.layout + G.H_ROOM}) != 0:")

    def _emit_layout(self, ctx, t) -> None:
        # the blob's capacity in bytes: a word of the run's state (storage.CappedBytes' limit)
        limit = getattr(self.output(0).storage, "limit", None) or str(INT32_MAX)
        name = ctx.use_helper("gb_layout", "grid_build")
        ctx.line(f"{name}(scratch_int, {self.S.ctr}, {self.S.summary}, {self.S.layout}, {self.B}, {limit})")

    # ---- the host's steps ---------------------------------------------------------------------
    def _lay_out(self, words: np.ndarray):
        """From the counters and the per-grid summaries: raise what the device flagged; return (layout
        rows [B, G_WORDS], headers [B, HEADER_SIZE] (builder.grid_header, numbered b of B like
        concat_grids), the blob's bytes, leaves, voxels)."""
        from luisaml.errors import RunError

        B = self.B
        ctr = words[:G.C_WORDS]
        rows = np.ascontiguousarray(words[G.C_WORDS:].reshape(B, G.S_WORDS))
        summary = rows.astype(np.int64)
        t = G.S_TRANSFORM  # (the clear stage copied the transforms rows)
        h = rows[:, t + G.T_H:t + G.T_H + 6].copy().view(np.float64)
        o = rows[:, t + G.T_O:t + G.T_O + 6].copy().view(np.float64)
        self._raise_flagged(ctr)
        what = self.who()
        layout = np.zeros((B, G.G_WORDS), np.int64)
        headers = np.zeros((B, HEADER_SIZE), np.uint8)
        offset = leaf = lower = upper = voxel = 0
        for b in range(B):
            nl, nlo, nup, nv = (int(v) for v in summary[b, :4])
            head, size = grid_header(nv, nl, nlo, nup, summary[b, 4:7], summary[b, 7:10], h[b], o[b])
            head = bytearray(head)
            struct.pack_into("<II", head, L.GRID_OFF_GRID_INDEX, b, B)  # (concat_grids' numbering)
            headers[b] = np.frombuffer(bytes(head), np.uint8)
            off_root, off_upper, off_lower, off_leaf, _ = grid_layout(nl, nlo, nup)
            tree = offset + L.GRID_DATA_SIZE
            layout[b, [G.G_OFFSET, G.G_ROOT, G.G_TILES, G.G_UPPER, G.G_LOWER, G.G_LEAF]] = (
                offset, tree + off_root, tree + off_root + L.ROOT_DATA_SIZE, tree + off_upper, tree + off_lower,
                tree + off_leaf)
            layout[b, [G.G_LEAF_START, G.G_LOWER_START, G.G_UPPER_START, G.G_VOXEL_START]] = leaf, lower, upper, voxel
            offset += size
            leaf, lower, upper, voxel = leaf + nl, lower + nlo, upper + nup, voxel + nv
        if leaf != int(ctr[G.C_LEAVES]):
            raise RunError(f"{what}: the device's grid summaries count {leaf} leaves, its hash {int(ctr[G.C_LEAVES])}")
        if offset > INT32_MAX:
            raise RunError(f"{what}: the new grids take {offset} bytes; the device builder writes at most 2 GiB "
                           "(32-bit offsets)")
        return layout, headers, offset, leaf, voxel

    def _host_step(self, words: np.ndarray) -> HostResult:
        """Mid-run (the host's layout): return the blob's bytes and the leaves as the rows of grid_blob
        and leaf_batch_indices, and the layout rows and headers to upload into the scratch."""
        S = self.S
        layout, headers, offset, leaf, voxel = self._lay_out(words)
        head = np.zeros(G.H_ROWS, np.int64)
        head[G.H_WORDS], head[G.H_VOXELS] = offset // 4, voxel
        writes = [(S.layout.value, np.concatenate([head, layout.reshape(-1)]).astype(np.int32)),
                  (S.headers.value, headers.reshape(-1).view(np.int32))]
        return HostResult({0: offset, 4: leaf}, writes)

    def _end_step(self, words: np.ndarray) -> HostResult:
        """At the run's end (the device's layout): raise what the device flagged in its counters."""
        self._raise_flagged(words)
        return HostResult()

    def _raise_flagged(self, ctr: np.ndarray) -> None:
        """Raise the error the device's stages recorded in the counter words, if any (gb_error's codes)."""
        from luisaml.errors import RunError

        err = int(ctr[G.C_ERROR])
        what = self.who()
        if err == G.ERR_OFFSETS:
            raise RunError(f"{what}: joffsets must rise from 0 to " + (f"at most {self.N}" if self.counted else
                                                                        f"{self.N} (the rows of jdata)"))
        if err == G.ERR_COORDS:
            raise RunError(f"{what}: {self.coords_error()}")
        if err == G.ERR_BYTES:
            raise RunError(f"{what}: the new grids take more than 2 GiB; the device builder writes at most 2 GiB "
                           "(32-bit offsets)")
        if err == G.ERR_LEAVES:
            raise RunError(f"{what}: the device's grid summaries count other leaves than its hash "
                           f"({int(ctr[G.C_LEAVES])})")
