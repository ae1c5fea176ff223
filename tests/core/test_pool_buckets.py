"""The sizes a network's buffers grow to (luisaml/pool.py `bucket`): the next quarter step of a power of
two, at most 25% past the count, not the next power of two (up to 100% past it: issue 28, the
detector's backbone held its 150k-row buffers at 262,144 rows). A count that moves makes a new buffer
only when it passes the largest so far; one that shrinks keeps it down to 1/KEEP."""
import numpy as np
from onnx import TensorProto, helper

import luisaml
from luisaml.pool import KEEP, BufferPool, bucket


def test_bucket_is_a_quarter_step_of_a_power_of_two():
    for count in list(range(1, 600)) + [100_000, 131_072, 150_000, 4_800_000, (1 << 30) + 1]:
        b = bucket(count)
        assert b >= count and (count <= 8 or b <= 1.25 * count), (count, b)
        k = b.bit_length() - 3
        assert b <= 8 or (b % (1 << k) == 0 and 4 <= b >> k <= 7 or b & (b - 1) == 0), (count, b)
    assert [bucket(c) for c in (100_000, 131_072, 150_000)] == [114_688, 131_072, 163_840]
    assert [bucket(c) for c in (1, 3, 9, 17)] == [1, 4, 10, 20]


def test_pool_sizes_inputs_and_kernel_buffers_by_bucket():
    luisaml.device.init("cpu")
    pool = BufferPool()
    assert pool.sized("x_points", "float", 150_000).size == 163_840  # (262,144 before)
    same = pool.sized("x_points", "float", 100_000)
    assert same.size == 163_840 and pool.sized("x_points", "float", 163_840) is same
    first = pool.pooled("buf_float_0", "float", 100_000)  # exact the first time
    assert first.size == 100_000 and pool.pooled("buf_float_0", "float", 60_000) is first
    grown = pool.pooled("buf_float_0", "float", 150_000)  # moved: its bucket
    assert grown.size == 163_840 and pool.pooled("buf_float_0", "float", 163_840 // KEEP) is grown


def test_a_network_whose_batch_moves_holds_its_buckets():
    """Batches of 100, 60, 150, 80 rows: the input, output and stage buffers end at 160 rows' bucket
    (not 256), made once past the first batch's."""
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Softmax", ["r"], ["s"], axis=-1),
                           helper.make_node("Sigmoid", ["s"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 32])])
    net = luisaml.compile(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    rng = np.random.default_rng(0)
    for n in (100, 60, 150, 80):
        x = rng.standard_normal((n, 32)).astype(np.float32)
        y = net.run({"x": x})["y"]
        assert y.shape == (n, 32)
    rows = {name: buf.size // 32 for (name, _), buf in net.pool.held.items()}
    assert rows and all(r <= 160 for r in rows.values()), rows
