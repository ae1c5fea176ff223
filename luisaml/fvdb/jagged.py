"""fVDB's JaggedTensor as plain numpy arrays: a list (or list of lists) of tensors sharing trailing dims.

The four arrays carry fVDB's meanings (``fvdb/jagged_tensor.py``, ``src/fvdb/JaggedTensor.h``):

- ``jdata``    ``[N, *]``: the tensors concatenated along their first axis.
- ``joffsets`` int64 ``[T+1]``: tensor t is ``jdata[joffsets[t]:joffsets[t+1]]``.
- ``jidx``     int32 ``[N]``: the tensor id of each element, ``repeat(arange(T), counts)``; empty
  (``[0]``) when there is a single tensor, as fVDB leaves it.
- ``jlidx``    int32 ``[T, ldim]``: the (list, sub-list) position of each tensor; empty ``[0, 1]``
  for a flat list (ldim 1).

Features of a GridBatch are a JaggedTensor whose ``joffsets`` equal the batch's ``batch_offsets`` and
whose rows are in each grid's linear-index order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class JaggedBundle(NamedTuple):
    """The four arrays a shader receives for a JaggedTensor, in this order."""

    jdata: np.ndarray
    joffsets: np.ndarray
    jidx: np.ndarray
    jlidx: np.ndarray


def jidx_from_offsets(joffsets: np.ndarray) -> np.ndarray:
    """Return fVDB's jidx (int32 [N]) for joffsets; empty when there is one tensor."""
    joffsets = np.asarray(joffsets, np.int64)
    if len(joffsets) <= 2:
        return np.zeros(0, np.int32)
    return np.repeat(np.arange(len(joffsets) - 1, dtype=np.int32), np.diff(joffsets))


def offsets_from_counts(counts: Sequence[int] | np.ndarray) -> np.ndarray:
    """Return int64 [T+1] offsets [0, c0, c0+c1, ...] of per-tensor element counts."""
    return np.concatenate([[0], np.cumsum(np.asarray(counts, np.int64))]).astype(np.int64)


def _concat(tensors: Sequence[np.ndarray]) -> np.ndarray:
    arrays = [np.asarray(t) for t in tensors]
    if not arrays:
        raise ValueError("a JaggedTensor needs at least one tensor")
    for i, a in enumerate(arrays):
        if a.ndim == 0:
            raise ValueError(f"tensor {i} is a scalar; every tensor needs a leading element axis")
        if a.shape[1:] != arrays[0].shape[1:]:
            raise ValueError(
                f"tensor {i} has trailing shape {a.shape[1:]}, tensor 0 has {arrays[0].shape[1:]}"
            )
        if a.dtype != arrays[0].dtype:
            raise TypeError(f"tensor {i} has dtype {a.dtype}, tensor 0 has {arrays[0].dtype}")
    return np.concatenate(arrays, axis=0)


@dataclass(frozen=True, eq=False)
class JaggedTensor:
    """A batch of tensors of different lengths, stored as fVDB's (jdata, joffsets, jidx, jlidx)."""

    jdata: np.ndarray
    joffsets: np.ndarray
    jidx: np.ndarray
    jlidx: np.ndarray

    def __post_init__(self) -> None:
        n = self.jdata.shape[0] if self.jdata.ndim else -1
        if self.jdata.ndim == 0:
            raise ValueError("jdata needs a leading element axis")
        if self.joffsets.dtype != np.int64 or self.joffsets.ndim != 1 or len(self.joffsets) < 2:
            raise ValueError(
                f"joffsets must be int64 [T+1] with T >= 1, got {self.joffsets.dtype} {self.joffsets.shape}"
            )
        if self.joffsets[0] != 0 or self.joffsets[-1] != n or (np.diff(self.joffsets) < 0).any():
            raise ValueError(f"joffsets must rise from 0 to len(jdata) = {n}, got {self.joffsets.tolist()}")
        t = len(self.joffsets) - 1
        if self.jidx.dtype != np.int32 or not (
            self.jidx.shape == (n,) or (t == 1 and self.jidx.shape == (0,))
        ):
            raise ValueError(
                f"jidx must be int32 [{n}] (or [0] for one tensor), got {self.jidx.dtype} {self.jidx.shape}"
            )
        if self.jlidx.dtype != np.int32 or self.jlidx.ndim != 2:
            raise ValueError(f"jlidx must be int32 [T, ldim], got {self.jlidx.dtype} {self.jlidx.shape}")
        if not (self.jlidx.shape == (0, 1) or self.jlidx.shape[0] == t):
            raise ValueError(f"jlidx must be [0, 1] for a flat list or [{t}, ldim], got {self.jlidx.shape}")

    @classmethod
    def from_data_and_offsets(cls, jdata: np.ndarray, joffsets: Sequence[int] | np.ndarray) -> JaggedTensor:
        """Return a flat (ldim 1) JaggedTensor over jdata split at joffsets."""
        offsets = np.asarray(joffsets, np.int64)
        return cls(np.asarray(jdata), offsets, jidx_from_offsets(offsets), np.zeros((0, 1), np.int32))

    @classmethod
    def from_list(cls, tensors: Sequence[np.ndarray]) -> JaggedTensor:
        """Return a flat (ldim 1) JaggedTensor of a list of arrays sharing trailing shape and dtype."""
        data = _concat(tensors)
        return cls.from_data_and_offsets(data, offsets_from_counts([len(np.asarray(t)) for t in tensors]))

    @classmethod
    def from_list_of_lists(cls, lists: Sequence[Sequence[np.ndarray]]) -> JaggedTensor:
        """Return an ldim-2 JaggedTensor of a list of lists of arrays (jlidx holds (list, item) per tensor)."""
        flat = [t for sub in lists for t in sub]
        data = _concat(flat)
        offsets = offsets_from_counts([len(np.asarray(t)) for t in flat])
        jlidx = np.array([(i, j) for i, sub in enumerate(lists) for j in range(len(sub))], np.int32).reshape(
            -1, 2
        )
        return cls(data, offsets, jidx_from_offsets(offsets), jlidx)

    @property
    def num_tensors(self) -> int:
        """Return T, the number of tensors."""
        return len(self.joffsets) - 1

    @property
    def ldim(self) -> int:
        """Return the list dimension: 1 for a flat list, 2 for a list of lists."""
        return 1 if self.jlidx.shape == (0, 1) else self.jlidx.shape[1]

    @property
    def lshape(self) -> list[int] | list[list[int]]:
        """Return the element count of each tensor (nested like the lists for ldim 2)."""
        counts = np.diff(self.joffsets).tolist()
        if self.ldim == 1:
            return counts
        out: list[list[int]] = []
        for (i, _j), c in zip(self.jlidx.tolist(), counts):
            while len(out) <= i:
                out.append([])
            out[i].append(c)
        return out

    def unbind(self) -> list[np.ndarray] | list[list[np.ndarray]]:
        """Return the tensors as a list (ldim 1) or list of lists (ldim 2)."""
        parts = [self.jdata[a:b] for a, b in zip(self.joffsets[:-1].tolist(), self.joffsets[1:].tolist())]
        if self.ldim == 1:
            return parts
        out: list[list[np.ndarray]] = []
        for (i, _j), p in zip(self.jlidx.tolist(), parts):
            while len(out) <= i:
                out.append([])
            out[i].append(p)
        return out

    def jagged_like(self, jdata: np.ndarray) -> JaggedTensor:
        """Return a JaggedTensor with this one's structure and new jdata (same leading length)."""
        jdata = np.asarray(jdata)
        if jdata.ndim == 0 or jdata.shape[0] != self.jdata.shape[0]:
            raise ValueError(f"jdata must have {self.jdata.shape[0]} rows, got shape {jdata.shape}")
        return JaggedTensor(jdata, self.joffsets, self.jidx, self.jlidx)

    def bundle(self) -> JaggedBundle:
        """Return (jdata, joffsets, jidx, jlidx), the arrays a shader binds."""
        return JaggedBundle(self.jdata, self.joffsets, self.jidx, self.jlidx)
