"""Host-side interop: numpy and torch inputs and outputs, and torch CUDA tensors shared with
LuisaCompute buffers through DLPack (no copies)."""
from __future__ import annotations

import numpy as np

from .errors import InputError, InputTypeError


def is_torch(x) -> bool:
    """Return whether x is a torch tensor (without importing torch)."""
    return type(x).__module__.startswith("torch")


def same_tensor(kept, t) -> bool:
    """Whether torch tensor t equals `kept` (a clone an earlier run made; None: no such clone) in
    shape, dtype, device and every element, compared where they live: a grid bound again is
    neither copied to the host nor hashed."""
    import torch

    return (kept is not None and kept.shape == t.shape and kept.dtype == t.dtype and kept.device == t.device
            and bool(torch.equal(kept, t)))


# torch dtypes numpy has no type for: a feed of one is refused by name rather than by torch's TypeError
_NO_NUMPY_DTYPE = ("bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "complex32")


def check_torch_dtype(t, name: str) -> None:
    """Raise InputTypeError naming the input if torch tensor t's dtype has no numpy type (bfloat16)."""
    kind = str(t.dtype).removeprefix("torch.")
    if kind in _NO_NUMPY_DTYPE:
        raise InputTypeError(f"input '{name}': torch dtype {kind} has no numpy type, so luisaml cannot read it; "
                             "convert it to the dtype the network expects first (x.float(), x.half(), x.to(...))")


def to_numpy(x, name: str) -> np.ndarray:
    """Return a feed as a numpy array (torch tensors are copied to the host)."""
    if is_torch(x):
        check_torch_dtype(x, name)
        return x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return x
    if np.isscalar(x) or isinstance(x, (list, tuple)):
        try:
            return np.asarray(x)
        except ValueError as e:  # a ragged list: numpy's message does not say which input
            raise InputError(f"input '{name}': a nested list whose rows differ in length (ragged) is not an "
                             f"array ({e})") from None
    raise InputTypeError(f"input '{name}': expected a numpy array or torch tensor, got {type(x).__name__}")


_TORCH_DTYPES: dict = {}  # numpy dtype -> torch dtype, made at the first torch_dtype (torch imported then)


def torch_dtype(np_dtype):
    """Return the torch dtype of a numpy dtype the kernels use."""
    if not _TORCH_DTYPES:  # (once: a zero-copy run asks ~3 times, the table cost ~3 us to build)
        import torch

        _TORCH_DTYPES.update({np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
                              np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64,
                              np.dtype(np.uint32): torch.uint32, np.dtype(np.bool_): torch.bool})
    return _TORCH_DTYPES[np.dtype(np_dtype)]


def dlpack_buffer(t):
    """Return a luisa.Buffer sharing a contiguous torch CUDA tensor's memory (an empty one gets a
    one-element buffer: a kernel never reads it)."""
    import luisa

    if t.numel() == 0:
        t = t.new_zeros(1)
    buf = luisa.Buffer.from_dlpack(t.reshape(-1))
    buf._torch_owner = t  # the tensor outlives the buffer that borrows it
    return buf
