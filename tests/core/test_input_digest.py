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
