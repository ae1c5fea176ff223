"""Every error luisaml raises on purpose: one base class, and a subclass per kind of offender.

Each message names what failed (the file, node, tensor, input or setting) and what was expected.
The classes also derive from the built-in exception a caller would have caught before they
existed (ValueError for a bad model, KeyError for an unknown input name, ...), so `except
ValueError` keeps working; `except luisaml.LuisamlError` catches them all.

Where the checks sit: an unsupported operator is a compile error (nothing silently falls back);
feeds numpy cannot read (a ragged list, a bfloat16 torch tensor) are refused by input name in
`interop.to_numpy`; `input_shapes` is checked by `planning.check_input_shapes`; a DilatedGrid or
RefinedGrid whose result must pass `luisaml.Limits` is a LimitError before it is built
(`fvdb/topology.check_result_size`, also on the host-step path).
"""
from __future__ import annotations


class LuisamlError(Exception):
    """Base of every error luisaml raises on purpose."""


class ModelError(LuisamlError, ValueError):
    """A model that cannot be loaded or compiled; the message names what failed."""


class CompileError(ModelError):
    """A node that cannot be compiled; the message names the node, its op type and what failed."""


class BatchMixingError(CompileError):
    """A node that cannot run one sample at a time (it reads other samples, or the batch size as
    data): the compiler then runs the graph with its shapes fixed at each run's batch size."""


class WeightsError(ModelError):
    """A weights file that is neither valid safetensors nor exactly the model's header-less blob,
    or a weight the model needs and the file lacks."""


class LimitError(ModelError):
    """A size beyond a configured limit (luisaml.Limits) or beyond the 32-bit range kernels index
    with, found before any memory is committed."""


class ArtifactError(ModelError):
    """A .lml artifact that cannot be loaded: not an artifact, damaged (a hash does not match), or
    holding a module the safe-source check refuses; the message names the file and what failed."""


class IncompatibleArtifact(ArtifactError):
    """A .lml artifact built by a luisaml, luisa-python or format version this one cannot run, or
    for another backend; the message says what to rebuild it with."""


class InputError(LuisamlError, ValueError):
    """Feeds that do not match the network's inputs (shape, batch size, value range)."""


class InputNameError(InputError, KeyError):
    """A feed or output name the network does not have, or a missing input."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class InputTypeError(InputError, TypeError):
    """A feed of the wrong element type or kind of object."""


class UsageError(LuisamlError, ValueError):
    """An option luisaml does not know, or a call that does not fit (forward before set_model)."""


class RangeError(LuisamlError, OverflowError):
    """A value beyond what a kernel's types hold: an int64 outside 32 bits, a float64 beyond
    float32's range."""


class RunError(LuisamlError, RuntimeError):
    """A failure found while running: an index out of range flagged by a kernel, a batch whose
    tensors exceed the 32-bit range, a kernel that could not be built."""


class CacheError(LuisamlError, OSError):
    """A cache folder that cannot be used; the message names the folders tried."""


class BackendUnavailable(LuisamlError, RuntimeError):
    """A backend that cannot run here; the message says what to install."""


__all__ = [
    "LuisamlError", "ModelError", "CompileError", "BatchMixingError", "WeightsError", "LimitError", "ArtifactError",
    "IncompatibleArtifact", "InputError",
    "InputNameError", "InputTypeError", "UsageError", "RangeError", "RunError", "CacheError", "BackendUnavailable",
]
