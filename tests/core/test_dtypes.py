"""Element types at the kernel boundary: uint8 in a ByteBuffer, float64 held as float32, int64 range."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import luisaml
from luisaml.storage import byte_load


@luisaml.register("ByteSum", domain="test.bytes", since=1)
class ByteSum(luisaml.Operator):
    """y[j] = sum of bytes [4j, 4j+4) of x, read through the storage's byte address."""

    @classmethod
    def infer(cls, node, inputs):
        return [(TensorProto.INT32, (inputs[0].shape[0] // 4,))]

    def forward(self, ctx):
        x, y = self.input(0), self.output()
        buf, base = x.storage.byte_address()
        with ctx.loop(y.numel) as j:
            acc = ctx.fresh("acc")
            ctx.line(f"{acc} = 0")
            with ctx.loop(4) as k:
                ctx.line(f"{acc} += int({byte_load(buf, f'{base} + {j} * 4 + {k}')})")
            ctx.store(y, j, acc)


def _bytes_model(const: np.ndarray | None):
    inputs = [] if const is not None else [helper.make_tensor_value_info("x", TensorProto.UINT8, [12])]
    inits = [numpy_helper.from_array(const, "x")] if const is not None else []
    g = helper.make_graph([helper.make_node("ByteSum", ["x"], ["y"], domain="test.bytes")], "g", inputs,
                          [helper.make_tensor_value_info("y", TensorProto.INT32, [3])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("test.bytes", 1)])


def test_uint8_input_and_constant_are_byte_addressable():
    data = np.array([1, 2, 3, 250, 255, 0, 7, 9, 128, 64, 32, 16], np.uint8)
    want = data.reshape(3, 4).astype(np.int32).sum(1)
    got = luisaml.compile(_bytes_model(None), batch_axis=None).run({"x": data})["y"]
    np.testing.assert_array_equal(got, want)
    # the same bytes as an initializer: they go to the weight blob and are read from there
    net = luisaml.compile(_bytes_model(data), batch_axis=None)
    np.testing.assert_array_equal(net.run({})["y"], want)
    assert "x" in net.weight_layout


def test_float64_is_rejected_by_generic_arithmetic():
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [3])],
                          [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(luisaml.CompileError, match=r"input 0 'x' has type double, expected float or int"):
        luisaml.compile(m, batch_axis=None)


def test_int64_out_of_range_is_an_error_not_a_truncation():
    g = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.INT64, [3])],
                          [helper.make_tensor_value_info("y", TensorProto.INT64, [3])])
    net = luisaml.compile(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), batch_axis=None)
    np.testing.assert_array_equal(net.run({"x": np.array([5, -7, 2**31 - 1], np.int64)})["y"], [-5, 7, -(2**31 - 1)])
    assert net.run({"x": np.array([1, 2, 3], np.int64)})["y"].dtype == np.int64
    with pytest.raises(OverflowError, match=r"input 'x': int64 value 4294967296 does not fit"):
        net.run({"x": np.array([1, 2**32, 3], np.int64)})


def test_float64_computed_as_float32_when_asked():
    g = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [3])],
                          [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    net = luisaml.compile(m, batch_axis=None, float64="float32")
    x = np.array([1.5, -2.25, 1e-3], np.float64)
    y = net.run({"x": x})["y"]
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, x * x, rtol=2 ** -22)  # float32 arithmetic: a couple of ulps
    with pytest.raises(OverflowError, match=r"input 'x': float64 value 1e\+200 is beyond float32's range"):
        net.run({"x": np.array([1.0, 1e200, 2.0])})


def test_a_constant_whose_linear_rebuild_leaves_float32_compiles_without_a_warning():
    """issue 29: storage.constant_storage cast the products of a constant's step past float32's range
    ("RuntimeWarning: overflow encountered in cast"); the range is checked first. [-3e38, 0, 3e38] is no
    arithmetic progression a kernel can compute (2 * 3e38 is inf in float32): it stays in the blob, and the
    network adds it as onnxruntime does."""
    import warnings

    import onnxruntime as ort

    from luisaml import dtypes
    from luisaml.storage import Linear, constant_storage

    c = np.array([-3e38, 0.0, 3e38], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not isinstance(constant_storage(c, dtypes.FLOAT), Linear)
        assert not isinstance(constant_storage(np.array([0, 2**30, 2**31 - 1], np.int64), dtypes.INT64), Linear)
        assert constant_storage(np.array([1.0, 2.5, 4.0], np.float32), dtypes.FLOAT) == Linear(1.0, 1.5, dtypes.FLOAT)
        g = helper.make_graph([helper.make_node("Add", ["x", "c"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])], [numpy_helper.from_array(c, "c")])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        x = np.array([1e37, 2.0, -1e37], np.float32)
        got = luisaml.compile(m, batch_axis=None).run({"x": x})["y"]
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)


def test_an_int64_constant_past_32_bits_is_refused_not_wrapped():
    """A constant [0, 2**32, 2**33] was cast to the kernel's 32-bit integers and wrapped into the
    progression Linear(0, 0): `x + c` returned [0, 0, 0] (numpy says [0, 2**32, 2**33]). It is now
    an error naming the constant and the value."""
    c = np.array([0, 2**32, 2**33], np.int64)
    g = helper.make_graph([helper.make_node("Add", ["x", "c"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.INT64, [3])],
                          [helper.make_tensor_value_info("y", TensorProto.INT64, [3])],
                          [numpy_helper.from_array(c, "c")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(luisaml.LuisamlError, match=r"constant 'c': int64 value 4294967296 does not fit"):
        luisaml.compile(m, batch_axis=None).run({"x": np.zeros(3, np.int64)})
