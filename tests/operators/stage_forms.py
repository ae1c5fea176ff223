"""Test helper: a batched model's nodes run in parallel stages (inline, or a thread per element or
work item) and match onnxruntime at several batch sizes."""
from __future__ import annotations


import numpy as np

from util import ort_run, stage_of

import luisaml


def assert_stage_forms(model, feeds_at, nodes, sizes=(2, 5), rtol=1e-5, atol=1e-6, **compile_kw):
    """Compile `model` once; assert that its outputs equal onnxruntime's for the feeds
    feeds_at(n) of each batch size n, and that each of `nodes` runs in an "element" or "items"
    stage (its own, or inline in the stage that reads it), not one thread per sample. Return the
    network."""
    net = luisaml.compile(model, **compile_kw)
    for n in sizes:
        feeds = feeds_at(n)
        got, want = net.run(feeds), ort_run(model, feeds)
        for name, w in want.items():
            g = got[name]
            assert g.dtype == w.dtype and g.shape == w.shape, f"{name} at batch {n}: {g.dtype} {g.shape}, want {w.dtype} {w.shape}"
            if w.dtype.kind in "fc":
                np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"{name} at batch {n}")
            else:
                np.testing.assert_array_equal(g, w, err_msg=f"{name} at batch {n}")
    for name in nodes:
        st = stage_of(net, name)
        assert st.domain in ("element", "items"), f"node '{name}' runs in {st.describe()}:\n{net.plan.schedule.describe()}"
    return net


def assert_per_batch(model, feeds_at, node, sizes=(2, 5), rtol=1e-5, atol=1e-6):
    """Assert that a model whose node `node` mixes samples across the batch compiles per batch size:
    its outputs equal onnxruntime's at each size, and `forward` (one sample) raises UsageError
    naming the node."""
    import pytest

    net = assert_stage_forms(model, feeds_at, [], sizes, rtol, atol, batch_axis=0)
    assert isinstance(net, luisaml.PerBatchNetwork), repr(net)
    with pytest.raises(luisaml.UsageError, match=f"node '{node}'"):
        net.forward
    return net
