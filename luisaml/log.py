"""luisaml's logging: the "luisaml" logger, timed compile phases, notes meant for a command-line
user, and a note when a kernel build runs long.

A library only emits records: it installs a NullHandler, and the application (or the command
line's -v) chooses handlers and levels. `logging.getLogger("luisaml").setLevel(logging.INFO)` with
a handler shows every phase and its time."""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Iterator

logger = logging.getLogger("luisaml")
logger.addHandler(logging.NullHandler())

# a kernel build slower than this gets a note saying what is being built
SLOW_BUILD_S = 2.0


def note(msg: str, *args) -> None:
    """Log at INFO a message a command-line user should see without -v (a cast input, a slow
    build); the CLI shows records marked `note` by default, -q hides them."""
    logger.info(msg, *args, extra={"note": True})


def _title(name: str, details: dict) -> str:
    return f"{name} ({', '.join(f'{k}={v}' for k, v in details.items())})" if details else name


@contextlib.contextmanager
def phase(name: str, *, note_after: float | None = None, **details) -> Iterator[None]:
    """Log the start and the elapsed time of a compile phase at INFO, e.g.
    `with phase("kernel build", model="mlp.onnx", note_after=SLOW_BUILD_S): ...`; with note_after,
    also note once when the phase has run longer than that (see `still_running`)."""
    if not logger.isEnabledFor(logging.INFO):
        yield
        return
    title = _title(name, details)
    logger.info("%s ...", title)
    t0 = time.perf_counter()
    slow = still_running(title, note_after) if note_after is not None else contextlib.nullcontext()
    try:
        with slow:
            yield
    except BaseException:
        logger.info("%s failed after %.2f s", name, time.perf_counter() - t0)
        raise
    logger.info("%s: %.2f s", name, time.perf_counter() - t0)


@contextlib.contextmanager
def still_running(what: str, after: float = SLOW_BUILD_S) -> Iterator[None]:
    """Note once, from a timer thread, that `what` is still running when the block takes longer
    than `after` seconds.

    The thread needs the GIL to log: LuisaCompute's native shader build (clang, NVRTC) holds it,
    so during that part the note comes when the build returns control to Python, not sooner."""
    if not logger.isEnabledFor(logging.INFO):
        yield
        return
    t0 = time.perf_counter()
    done = threading.Event()

    def remind() -> None:
        if not done.wait(after) and not done.is_set():
            note("%s: still running after %.0f s ...", what, time.perf_counter() - t0)

    threading.Thread(target=remind, name="luisaml-still-running", daemon=True).start()
    try:
        yield
    finally:
        done.set()


__all__ = ["logger", "note", "phase", "still_running", "SLOW_BUILD_S"]
