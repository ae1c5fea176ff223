"""What luisaml asks of the LuisaCompute device, counted: kernel launches, host synchronisations (the
host waiting for the stream: a run's end, a row count read back, a synchronous copy), copies each way
(commands), and the bytes of the device buffers luisaml holds with their peak.

The counts are the process's, as the device and its stream are (DESIGN.md: the one device): `install`
wraps luisa-python's stream once, when device.init starts it, so that every command luisaml or
luisa-python adds (a network's, a host step's device build's, a zero-copy run's) is seen;
`allocated` is called where luisaml creates a buffer (pool.py, luisa_compat.py) and the bytes are
released when the buffer is collected. `measure()` gives the counts of the code inside it (one run:
issue 28's counted execution, `CompiledNetwork.profile`)."""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, fields


@dataclass
class Counts:
    """Counts of device work: kernel launches, host synchronisations, uploads and downloads
    (commands), device bytes luisaml's buffers held at the end and at their peak."""

    launches: int = 0
    syncs: int = 0
    uploads: int = 0
    downloads: int = 0
    held_bytes: int = 0
    peak_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counts as a plain dict (a results JSON's)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


_SUMMED = ("launches", "syncs", "uploads", "downloads")
_total = Counts()  # the process's, since install; held_bytes live, peak_bytes since the innermost measure


class CountingStream:
    """luisa-python's stream with its commands counted (`add`: a compute dispatch, an upload, a
    download; `synchronize`); every other attribute is the stream's own."""

    def __init__(self, stream) -> None:
        from luisa import lcapi

        self._stream = stream
        kinds = {"launches": ("ShaderDispatchCommand",), "uploads": ("BufferUploadCommand",),
                 "downloads": ("BufferDownloadCommand",)}
        self._kinds = {k: tuple(getattr(lcapi, n) for n in names if hasattr(lcapi, n)) for k, names in kinds.items()}

    def add(self, command) -> None:
        """Enqueue command on the stream, counting it by kind."""
        if isinstance(command, self._kinds["launches"]):
            _total.launches += 1
        elif isinstance(command, self._kinds["uploads"]):
            _total.uploads += 1
        elif isinstance(command, self._kinds["downloads"]):
            _total.downloads += 1
        self._stream.add(command)

    def add_launches(self):
        """Return (add, done): add(command) enqueues a compute dispatch uncounted, done(k) counts k
        launches at once: a network's launch loop (luisaml/launch.py) skips `add`'s isinstance tests
        and a Python call for each of its stages (benchmarks/NOTES.md, "net.run's host time")."""
        def done(k: int) -> None:
            _total.launches += k

        return self._stream.add, done

    def synchronize(self) -> None:
        """Wait for the stream, counted as one host synchronisation."""
        _total.syncs += 1
        self._stream.synchronize()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def install() -> None:
    """Count the commands of luisa-python's stream (once, after the device started)."""
    from luisa import globalvars

    if not isinstance(globalvars.vars.stream, CountingStream):
        globalvars.vars.stream = CountingStream(globalvars.vars.stream)


def synchronised() -> None:
    """Count a host synchronisation made outside luisa-python's stream (a torch stream's)."""
    _total.syncs += 1


def _release(nbytes: int) -> None:
    _total.held_bytes -= nbytes


def allocated(buf):
    """Count buf's bytes as held until it is collected; return buf."""
    nbytes = int(getattr(buf, "bytesize", 0))
    _total.held_bytes += nbytes
    _total.peak_bytes = max(_total.peak_bytes, _total.held_bytes)
    weakref.finalize(buf, _release, nbytes)
    return buf


def snapshot() -> Counts:
    """The process's counts so far (held_bytes: now; peak_bytes: since the innermost measure began)."""
    return Counts(**_total.as_dict())


@contextlib.contextmanager
def measure():
    """Yield a Counts filled, when the block ends, with what the block asked of the device: its
    launches, synchronisations and copies, the bytes held at its end and their peak inside it."""
    out = Counts()
    before = snapshot()
    outer_peak = _total.peak_bytes
    _total.peak_bytes = _total.held_bytes
    try:
        yield out
    finally:
        for name in _SUMMED:
            setattr(out, name, getattr(_total, name) - getattr(before, name))
        out.held_bytes, out.peak_bytes = _total.held_bytes, _total.peak_bytes
        _total.peak_bytes = max(outer_peak, _total.peak_bytes)
