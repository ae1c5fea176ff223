"""CLI: every error of `luisaml run | inspect | emit | bench` is one line on stderr and a non-zero
exit status, never a traceback, and the line names what was wrong (the file, the input, the
node, the option).

Most cases call luisaml.cli.main in this worker (an exception escaping main() is what a user
would see as a traceback); a few run the real `python -m luisaml.cli` process.
"""
from __future__ import annotations

import numpy as np
from onnx import helper

from .. import actions
from ..harness import (
    FAIL_ERROR,
    FAIL_HARNESS,
    Case,
    Fail,
    attempt,
    judge,
    recipe,
    short,
)
from ..models import I64, F, make_model, mlp, mlp_reference, save, vi


def _setup(ctx, key: str) -> tuple[list[str], object]:
    """Return (argv, offender) for one CLI misuse, with its files in the case folder."""
    d = ctx.dir
    model = save(mlp(), d / "mlp.onnx")
    x = np.random.default_rng(0).uniform(-1, 1, (3, 4)).astype(np.float32)
    np.save(d / "x.npy", x)
    if key == "missing_model":
        return ["run", str(d / "nowhere.onnx")], "nowhere.onnx"
    if key == "model_is_directory":
        (d / "folder.onnx").mkdir()
        return ["run", str(d / "folder.onnx")], "folder.onnx"
    if key == "empty_model":
        (d / "empty.onnx").write_bytes(b"")
        return ["run", str(d / "empty.onnx")], "empty.onnx"
    if key == "garbage_model":
        (d / "garbage.onnx").write_bytes(np.random.default_rng(1).bytes(3000))
        return ["run", str(d / "garbage.onnx")], "garbage.onnx"
    if key == "unsupported_op":
        m = make_model([helper.make_node("FooBar", ["x"], ["y"], name="mystery_node")], [vi("x", F, ["N", 4])],
                       [vi("y", F, ["N", 4])], infer=False)
        return ["run", save(m, d / "foo.onnx")], "mystery_node"
    if key == "missing_weights":
        return ["run", model, "--weights", str(d / "nowhere.safetensors")], "nowhere.safetensors"
    if key == "garbage_weights":
        (d / "garbage.bin").write_bytes(b"\x01" * 37)
        return ["run", model, "--weights", str(d / "garbage.bin")], "garbage.bin"
    if key == "input_without_equals":
        return ["run", model, "--input", "x.npy"], "x.npy"
    if key == "input_missing_file":
        return ["run", model, "--input", f"x={d / 'nope.npy'}"], "nope.npy"
    if key == "input_not_npy":
        (d / "text.npy").write_text("hello")
        return ["run", model, "--input", f"x={d / 'text.npy'}"], "text.npy"
    if key == "input_pickled":
        np.save(d / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
        return ["run", model, "--input", f"x={d / 'obj.npy'}"], ("obj.npy", "x")
    if key == "input_unknown_name":
        return ["run", model, "--input", f"zz_unknown={d / 'x.npy'}"], "zz_unknown"
    if key == "input_float64_cast":  # the CLI casts float64 to float32 (with a note): may work
        np.save(d / "x64.npy", x.astype(np.float64))
        return ["run", model, "--input", f"x={d / 'x64.npy'}"], "x"
    if key == "input_wrong_dtype":  # floats for an int64 input: no cast of the same kind
        m = make_model([helper.make_node("Add", ["i", "one"], ["y"], name="add")], [vi("i", I64, ["N", 2])],
                       [vi("y", I64, ["N", 2])], {"one": np.array(1, np.int64)})
        np.save(d / "f.npy", np.zeros((1, 2), np.float64))
        return ["run", save(m, d / "int.onnx"), "--input", f"i={d / 'f.npy'}"], "i"
    if key == "input_wrong_shape":
        np.save(d / "x3.npy", x[:, :3])
        return ["run", model, "--input", f"x={d / 'x3.npy'}"], "x"
    if key == "batch_negative":
        return ["run", model, "--batch", "-2"], ("batch", "-2")
    if key == "out_is_file":
        (d / "outfile").write_text("a file")
        return ["run", model, "--input", f"x={d / 'x.npy'}", "--out", str(d / "outfile")], "outfile"
    if key == "out_unwritable":
        return ["run", model, "--input", f"x={d / 'x.npy'}", "--out", "/proc/luisaml-out"], "/proc/luisaml-out"
    if key == "inspect_garbage":
        (d / "garbage.onnx").write_bytes(b"\xff" * 100)
        return ["inspect", str(d / "garbage.onnx")], "garbage.onnx"
    if key == "emit_garbage":
        (d / "garbage.onnx").write_bytes(b"\xff" * 100)
        return ["emit", str(d / "garbage.onnx")], "garbage.onnx"
    if key == "emit_missing":
        return ["emit", str(d / "nowhere.onnx")], "nowhere.onnx"
    if key == "bench_repeat_zero":
        return ["bench", model, "--batch", "4", "--repeat", "0"], ("repeat", "0")
    if key == "bench_batch_negative":
        return ["bench", model, "--batch", "-5", "--repeat", "1"], ("batch", "-5")
    if key == "deep_json_model":
        (d / "deep.json").write_text('{"graph": {"node": ' + "[" * 100_000 + "]" * 100_000 + "}}")
        return ["run", str(d / "deep.json")], "deep.json"
    if key == "json_bad_utf8":
        (d / "bad.json").write_bytes(b'{"graph": {"name": "\xff\xfe"}}')
        return ["run", str(d / "bad.json")], "bad.json"
    if key == "gather_index_out_of_range":
        m = make_model([helper.make_node("Gather", ["table", "idx"], ["y"], name="gather_rows", axis=0)],
                       [vi("idx", I64, ["N", 2])], [vi("y", F, ["N", 2, 3])], {"table": np.ones((5, 3), np.float32)})
        np.save(d / "idx.npy", np.array([[0, 9]], np.int64))
        return ["run", save(m, d / "gather.onnx"), "--input", f"idx={d / 'idx.npy'}"], "gather_rows"
    if key == "int64_input_out_of_range":
        m = make_model([helper.make_node("Add", ["i", "one"], ["y"], name="add")], [vi("i", I64, ["N", 2])],
                       [vi("y", I64, ["N", 2])], {"one": np.array(1, np.int64)})
        np.save(d / "i.npy", np.array([[2**40, 0]], np.int64))
        return ["run", save(m, d / "int.onnx"), "--input", f"i={d / 'i.npy'}"], "i"
    if key == "model_cycle":
        m = make_model([helper.make_node("Add", ["x", "s"], ["s"], name="loop_add"),
                        helper.make_node("Relu", ["s"], ["y"], name="relu")], [vi("x", F, ["N", 4])],
                       [vi("y", F, ["N", 4])], infer=False)
        return ["run", save(m, d / "cycle.onnx")], ("loop_add", "s")
    raise Fail(FAIL_HARNESS, f"unknown CLI case {key!r}")


KEYS = ("missing_model", "model_is_directory", "empty_model", "garbage_model", "unsupported_op", "missing_weights",
        "garbage_weights", "input_without_equals", "input_missing_file", "input_not_npy", "input_pickled",
        "input_unknown_name", "input_float64_cast", "input_wrong_dtype", "input_wrong_shape", "batch_negative", "out_is_file",
        "out_unwritable", "inspect_garbage", "emit_garbage", "emit_missing", "bench_repeat_zero",
        "bench_batch_negative", "deep_json_model", "json_bad_utf8", "gather_index_out_of_range",
        "int64_input_out_of_range", "model_cycle")
# misuses the CLI may also accept (then it must not print a traceback, and nothing is checked)
MAY_WORK = {"bench_repeat_zero", "batch_negative", "bench_batch_negative", "input_float64_cast"}


@recipe("cli.error")
def cli_error(ctx, key: str, process: bool = False) -> None:
    argv, offender = _setup(ctx, key)
    if process:
        res = actions.cli_subprocess(argv, cwd=ctx.dir)
    else:
        a = attempt(actions.cli_inprocess, argv)
        judge(a, what="luisaml " + argv[0])  # an exception escaping main() is a traceback for a user
        res = a.value
    if res.code == 0:
        if key in MAY_WORK:
            if "Traceback" in res.stderr:
                raise Fail(FAIL_ERROR, f"exit 0 with a traceback: {short(res.stderr[-300:])}")
            return
        raise Fail(FAIL_ERROR, f"luisaml {argv[0]} exited 0 for {key}: {short(res.stdout[-200:] + res.stderr[-200:])}")
    actions.judge_cli(res, offender)


@recipe("cli.ok")
def cli_ok(ctx, process: bool = False) -> None:
    """The regression case: a good run prints outputs and exits 0, and they are right."""
    d = ctx.dir
    model = save(mlp(), d / "mlp.onnx")
    x = np.random.default_rng(0).uniform(-1, 1, (3, 4)).astype(np.float32)
    argv = actions.cli_args_for(model, {"x": x}, d)
    res = actions.cli_subprocess(argv, cwd=d) if process else actions.cli_inprocess(argv)
    if res.code != 0:
        raise Fail(FAIL_ERROR, f"a valid run exited {res.code}: {short(res.stderr[-300:])}")
    got = actions.cli_outputs(res, d, ["y"])
    judge(attempt(lambda: got), reference=mlp_reference(x), rtol=1e-5, atol=1e-5)


_PROCESS = ("missing_model", "garbage_model", "input_wrong_dtype", "deep_json_model", "gather_index_out_of_range")
_CI = {"garbage_model", "input_wrong_shape", "deep_json_model", "gather_index_out_of_range", "bench_repeat_zero"}


def cases() -> list[Case]:
    out = [Case(f"cli/{key}", "cli", "cli.error", dict(key=key), ci=key in _CI) for key in KEYS]
    out += [Case(f"cli/process/{key}", "cli", "cli.error", dict(key=key, process=True), timeout=150,
                 ci=key == "missing_model") for key in _PROCESS]
    out += [Case("cli/ok", "cli", "cli.ok", {}), Case("cli/process/ok", "cli", "cli.ok", dict(process=True), timeout=150)]
    return out
