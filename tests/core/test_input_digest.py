"""feeds.bytes_digest, the digest by which a run decides whether a bound input (a grid's blob)
is the one the derived inputs were computed from: a change of any byte, in any chunk of a large
array's tree, changes it; equal bytes anywhere give equal digests; memory hashed once in a run is
not hashed again (a fine and a coarse map's bundles are views of one blob)."""
import hashlib

import numpy as np

from luisaml import feeds


def test_any_byte_of_a_large_array_changes_its_digest():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, feeds.PARALLEL_HASH_BYTES + 3 * feeds.HASH_CHUNK + 17, dtype=np.uint8)
    d = feeds.bytes_digest(a, None)
    for where in (0, feeds.HASH_CHUNK - 1, feeds.HASH_CHUNK, a.size - 1):
        b = a.copy()
        b[where] ^= 1
        assert feeds.bytes_digest(b, None) != d, where
    assert feeds.bytes_digest(a.copy(), None) == d  # the same bytes elsewhere in memory
    small = a[:1000]
    assert feeds.bytes_digest(np.ascontiguousarray(small), None) == hashlib.blake2b(small.tobytes(), digest_size=16).digest()


def test_a_run_hashes_shared_memory_once(monkeypatch):
    blob = np.arange(feeds.PARALLEL_HASH_BYTES + 5, dtype=np.uint8)
    fine, coarse = blob[:], blob.view()  # two bundles' views of one grid's blob
    calls = []
    real = hashlib.blake2b

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    seen: dict = {}
    monkeypatch.setattr(feeds.hashlib, "blake2b", counting)
    first = feeds.bytes_digest(fine, seen)
    n = len(calls)
    assert feeds.bytes_digest(coarse, seen) == first and len(calls) == n
    arrays = {"in_grid_blob": fine, "out_grid_blob": coarse}
    a = feeds.input_digest(arrays, "in_grid_blob", False, seen)
    b = feeds.input_digest(arrays, "out_grid_blob", False, seen)
    assert a != b  # (the input's name is part of its digest)


def test_a_frozen_array_is_hashed_once_while_it_lives_and_a_writeable_one_every_time(monkeypatch):
    """A read-only array owning its memory (a detector's frozen points, bound to A and then B) keeps its
    digest across runs; a writeable one, or one made writeable again, is hashed again, and a changed byte
    gives a new digest (hashlib's blake2b the reference)."""
    import gc

    calls = []
    real = hashlib.blake2b
    monkeypatch.setattr(feeds.hashlib, "blake2b", lambda *a, **k: calls.append(1) or real(*a, **k))
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, 5000, dtype=np.uint8)
    want = real(a.tobytes(), digest_size=16).digest()
    for _ in range(2):
        assert feeds.bytes_digest(a, {}) == want
    assert len(calls) == 2  # writeable: hashed every run
    a.flags.writeable = False
    calls.clear()
    for _ in range(3):
        assert feeds.bytes_digest(a, {}) == want
    assert len(calls) == 1
    view = a[:]  # (a view of frozen memory: frozen too)
    assert feeds.bytes_digest(view, None) == want
    a.flags.writeable = True
    a[7] ^= 1
    calls.clear()
    assert feeds.bytes_digest(a, {}) == real(a.tobytes(), digest_size=16).digest() != want and len(calls) == 1
    a.flags.writeable = False
    assert feeds.bytes_digest(a, None) == real(a.tobytes(), digest_size=16).digest()  # (not the stale one)
    ident = id(a)
    del a, view
    gc.collect()
    assert ident not in feeds._FROZEN_DIGESTS  # (gone with its array: an id reused finds nothing)
