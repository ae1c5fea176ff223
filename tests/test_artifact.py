"""The .lml artifact (luisaml/artifact.py): build -> load in a fresh process -> the same outputs bit
for bit as the compiled network (and onnxruntime's within tolerance), without importing onnx or
torch; damaged, foreign, incompatible and unsafe files refused with ArtifactError; the session API
and `forward` over a loaded network; dispatch sizes written as data equal the stages' own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from util import assert_close_to_ort, assert_same_bits, export_batched, graph_model, ort_run, torch_mlp, value_info

import luisaml
from luisaml import artifact, dtypes

# a fresh process loads the artifact, says which heavy modules it imported, and saves the outputs
LOAD_AND_RUN = """
import sys, json, numpy as np, luisaml
net = luisaml.load(sys.argv[1])
feeds = dict(np.load(sys.argv[2]))
out = net.run(feeds)
np.savez(sys.argv[3], **out)
print(json.dumps({"imported": [m for m in ("onnx", "torch", "onnxruntime") if m in sys.modules],
                  "backend": net.backend}))
"""


def _load_in_fresh_process(path, feeds: dict, tmp_path) -> tuple[dict, dict]:
    """Return (outputs, what the process said) of luisaml.load(path).run(feeds) in a new process."""
    np.savez(tmp_path / "feeds.npz", **feeds)
    env = dict(os.environ, LUISAML_BACKEND="cpu")
    # cwd: the folder `-c` puts on sys.path, never a checkout that would shadow the luisaml in use
    r = subprocess.run([sys.executable, "-c", LOAD_AND_RUN, str(path), str(tmp_path / "feeds.npz"),
                        str(tmp_path / "out.npz")], capture_output=True, text=True, env=env, timeout=600,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    with np.load(tmp_path / "out.npz") as z:
        return {k: z[k] for k in z.files}, json.loads(r.stdout.strip().splitlines()[-1])


def _mixed_model():
    """A batched graph with a run-time checked Gather, an int64 output (ArgMax) and a constant
    passed straight to an output: the kinds of thing the manifest records besides stages."""
    table = np.random.default_rng(3).standard_normal((10, 4)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "idx"], ["g"], name="gather"),
             helper.make_node("ReduceSum", ["g", "axes"], ["s"], keepdims=0, name="sum"),
             helper.make_node("ArgMax", ["s"], ["am"], axis=1, keepdims=0, name="argmax"),
             helper.make_node("Relu", ["s"], ["r"], name="relu")]
    idx = np.random.default_rng(4).integers(0, 10, (5, 3)).astype(np.int64)
    model = graph_model(nodes, {"idx": idx}, {"table": table, "axes": np.array([2], np.int64),
                                             "c": np.arange(3, dtype=np.float32)}, batch="N")
    model.graph.output.extend([value_info("c", np.float32, [3])])
    return model, {"idx": idx}


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """(onnx path, compiled network, feeds, its outputs, the .lml) of a batched MLP."""
    d = tmp_path_factory.mktemp("mlp")
    path = export_batched(torch_mlp([8, 32, 32, 3]), 8, d / "mlp.onnx")
    net = luisaml.compile(path)
    feeds = {"x": np.random.default_rng(0).standard_normal((37, 8)).astype(np.float32)}
    out = net.run(feeds)
    lml = net.save(d / "mlp.lml", model_name="mlp.onnx")
    return path, net, feeds, out, lml


def test_round_trip_in_a_fresh_process_is_bit_for_bit_without_onnx_or_torch(mlp, tmp_path):
    path, net, feeds, want, lml = mlp
    got, said = _load_in_fresh_process(lml, feeds, tmp_path)
    assert said == {"imported": [], "backend": "cpu"}
    assert_same_bits(got, want)
    assert_close_to_ort(got, onnx.load(path), feeds)


def test_round_trip_of_checks_int64_and_outputs_no_node_writes(tmp_path):
    model, feeds = _mixed_model()
    net = luisaml.compile(model)
    assert net.plan.checks and net.plan.host_outputs == ["c"]
    want = net.run(feeds)
    lml = net.save(tmp_path / "mixed.lml")
    got, said = _load_in_fresh_process(lml, feeds, tmp_path)
    assert said["imported"] == []
    assert_same_bits(got, want)
    assert_close_to_ort(got, model, feeds)
    # an index out of range is still caught, naming the node, in the loaded network
    loaded = luisaml.load(lml)
    with pytest.raises(luisaml.RunError, match="Gather"):
        loaded.run({"idx": np.full((2, 3), 10, np.int64)})


def test_a_loaded_network_runs_like_the_compiled_one(mlp):
    path, net, feeds, want, lml = mlp
    loaded = luisaml.load(lml)
    assert repr(loaded) == repr(net) and loaded.output_names == net.output_names
    assert loaded.allocation.report() == net.allocation.report()
    assert loaded.plan.schedule.describe() == net.plan.schedule.describe()
    assert loaded.weight_bytes() == net.weight_bytes() and loaded.weight_layout == net.weight_layout
    assert_same_bits(loaded.run(feeds), want)
    assert_same_bits(loaded.run(None, feeds), want)  # onnxruntime's argument order too
    for n in (0, 1, 5):  # other batch sizes, stage by stage
        x = feeds["x"][:n]
        assert_same_bits(loaded.run({"x": x}), net.run({"x": x}))
    assert [k for k, _ in loaded.profile(feeds, repeat=1)] == [k for k, _ in net.profile(feeds, repeat=1)]
    # embedding: the same per-sample function and array types
    assert loaded.forward is not None and loaded.input_type("x") == net.input_type("x")
    with pytest.raises(luisaml.InputError, match=r"expected shape \[batch, 8\]"):
        loaded.run({"x": np.zeros((2, 9), np.float32)})
    assert loaded.artifact.model == "mlp.onnx" and loaded.artifact.backend == "cpu"


def test_a_loaded_network_saves_the_same_artifact(mlp, tmp_path):
    *_, lml = mlp
    again = luisaml.load(lml).save(tmp_path / "again.lml")
    a, b = artifact.read(lml), artifact.read(again)
    assert a.members == b.members
    assert a.manifest["source_sha256"] == b.manifest["source_sha256"] and a.built_with == b.built_with


def test_inference_session_over_an_artifact(mlp):
    path, net, feeds, want, lml = mlp
    sess = luisaml.InferenceSession(str(lml), providers=["CPUExecutionProvider"])
    ref = luisaml.InferenceSession(path, providers=["CPUExecutionProvider"])
    assert [(a.name, a.shape, a.type) for a in sess.get_inputs()] == [(a.name, a.shape, a.type) for a in ref.get_inputs()]
    assert [(a.name, a.type) for a in sess.get_outputs()] == [(a.name, a.type) for a in ref.get_outputs()]
    y, = sess.run(None, feeds)
    assert y.tobytes() == want["y"].tobytes()
    with pytest.raises(luisaml.UsageError, match="fixed when it was built"):
        luisaml.InferenceSession(str(lml), batch_axis=None)
    with pytest.raises(luisaml.IncompatibleArtifact, match="built for the cpu backend"):
        luisaml.InferenceSession(str(lml), providers=["CUDAExecutionProvider"])


# ---- refusals -----------------------------------------------------------------------------------
def _rewrite(src, dst, *, members=None, manifest=None, rehash=True):
    """Copy an artifact, replacing members and manifest keys; with rehash, the member hashes and
    the content hash are made to match again (what a tamperer can do)."""
    with zipfile.ZipFile(src) as z:
        m = json.loads(z.read("manifest.json"))
        data = {n: z.read(n) for n in z.namelist() if n != "manifest.json"}
    data.update(members or {})
    m.update(manifest or {})
    if rehash:
        import hashlib

        m["members"] = {k: {"sha256": hashlib.sha256(v).hexdigest(), "bytes": len(v)} for k, v in data.items()}
        m["content_hash"] = artifact.content_hash(m)
    with zipfile.ZipFile(dst, "w") as z:
        z.writestr("manifest.json", json.dumps(m))
        for k, v in data.items():
            z.writestr(k, v)
    return dst


def test_damaged_files_are_refused(mlp, tmp_path):
    *_, lml = mlp
    raw = open(lml, "rb").read()
    weights = bytearray(artifact.read(lml).members["weights.bin"])
    weights[5] ^= 1
    cases = {
        "a flipped weight bit": _rewrite(lml, tmp_path / "w.lml", members={"weights.bin": bytes(weights)}, rehash=False),
        "an edited manifest": _rewrite(lml, tmp_path / "m.lml", manifest={"model": "other"}, rehash=False),
    }
    for what, p in cases.items():
        with pytest.raises(luisaml.ArtifactError, match="is damaged"):
            luisaml.load(p)
    (tmp_path / "cut.lml").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "text.lml").write_text("hello")
    for name in ("cut.lml", "text.lml"):
        with pytest.raises(luisaml.ArtifactError, match="not a luisaml artifact|damaged"):
            luisaml.load(tmp_path / name)
    malformed = _rewrite(lml, tmp_path / "n.lml", members={"model.json": b'{"schema": 1}'})  # hashes made to match
    with pytest.raises(luisaml.ArtifactError, match="model.json .*no key 'model'"):
        luisaml.load(malformed)
    with zipfile.ZipFile(tmp_path / "zip.lml", "w") as z:
        z.writestr("a.txt", "x")
    with pytest.raises(luisaml.ArtifactError, match="without manifest.json"):
        luisaml.load(tmp_path / "zip.lml")


@pytest.mark.parametrize("change, says", [
    ({"format_version": 3}, r"format version 3, this luisaml \(.*\) reads version 2: upgrade luisaml"),
    ({"format_version": 1}, r"format version 1, .* reads version 2: build it again with `luisaml build`"),
    ({"format_version": 0}, r"format version 0.*build it again"),
    ({"backend": "cuda"}, r"built for the cuda backend and cannot run on cpu"),
    ({"built_with": {"luisaml": "0.1.0", "luisa_python": "0.0.1", "python": "3", "numpy": "1", "shaders": {}}},
     r"built with luisa-python 0\.0\.1, this process has luisa-python"),
])
def test_incompatible_files_are_refused_saying_what_to_do(mlp, tmp_path, change, says):
    *_, lml = mlp
    with pytest.raises(luisaml.ArtifactError, match=says) as e:
        luisaml.load(_rewrite(lml, tmp_path / "x.lml", manifest=change))
    assert isinstance(e.value, luisaml.IncompatibleArtifact)


def test_another_luisaml_version_is_refused_here_and_on_the_command_line(mlp, tmp_path, capsys):
    """The luisaml version is checked on its own (the luisa-python case above fails first on it
    only when both differ), and the CLI says it in one line with exit code 2."""
    from luisaml.cli import main

    *_, lml = mlp
    built = dict(artifact.read(lml).built_with)
    here = luisaml.__version__
    built["luisaml"] = here + ".other"
    old = _rewrite(lml, tmp_path / "old.lml", manifest={"built_with": built})
    with pytest.raises(luisaml.IncompatibleArtifact,
                       match=rf"built with luisaml {here}\.other, this process has luisaml {here}: build it again"):
        luisaml.load(old)
    for command in ("run", "bench"):
        assert main([command, str(old)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("luisaml: error: ") and "build it again" in err[0], err
    assert main(["inspect", str(old)]) == 0  # reading it needs no compatible runtime
    assert f"with luisaml {here}.other" in capsys.readouterr().out


def test_networks_an_artifact_cannot_hold_are_refused(tmp_path):
    import torch

    class Norm(torch.nn.Module):
        def forward(self, x):
            return x - x.mean(dim=0, keepdim=True)  # mixes samples: compiled per batch size

    path = tmp_path / "norm.onnx"
    torch.onnx.export(Norm(), (torch.randn(3, 4),), str(path), dynamo=False, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "n"}, "y": {0: "n"}})
    net = luisaml.compile(path)
    with pytest.raises(luisaml.UsageError, match="compiles per batch size.*--input-shapes"):
        net.save(tmp_path / "norm.lml")
    assert not (tmp_path / "norm.lml").exists()


def test_onnx_type_numbers_written_out_are_onnxs():
    for name, number in dtypes.ONNX_TYPES.items():
        assert getattr(TensorProto, name) == number
    assert dtypes.onnx_name(TensorProto.FLOAT8E4M3FN) == "FLOAT8E4M3FN"  # beyond the table: asks onnx


def test_import_luisaml_and_load_leave_onnx_alone(tmp_path):
    code = ("import sys, luisaml; assert 'onnx' not in sys.modules and 'torch' not in sys.modules; "
            "luisaml.InferenceSession, luisaml.CompiledNetwork, luisaml.load; assert 'onnx' not in sys.modules; "
            "luisaml.compile; assert 'onnx' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)


def test_manifest_is_documented_json_and_holds_no_pickle(mlp):
    *_, lml = mlp
    with zipfile.ZipFile(lml) as z:
        assert z.namelist()[0] == "manifest.json"
        assert set(z.namelist()) == {"manifest.json", "model.json", "weights.bin", "report.json"}
        assert z.getinfo("weights.bin").compress_type == zipfile.ZIP_STORED
        m = json.loads(z.read("manifest.json"))
    assert m["format"] == "luisaml-artifact" and m["format_version"] == artifact.FORMAT_VERSION
    assert set(m["built_with"]) == {"luisaml", "luisa_python", "python", "numpy", "shaders"}
    assert m["content_hash"] == artifact.content_hash(m)
    report = artifact.read(lml).report
    assert report["schema"] == 1 and report["model"] == "mlp.onnx" and report["stages"]


@pytest.mark.slow
def test_rapidocr_text_direction_classifier_round_trip(tmp_path, tmp_path_factory):
    """The issue's CPU load-time model (benchmarks/bench_load.py times it): bit for bit after a
    fresh-process load, and onnxruntime's outputs within the real-model suite's tolerance."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "models"))
    from test_real_models import _wheel_file

    raw = _wheel_file(tmp_path_factory, "rapidocr-onnxruntime==1.4.4",
                      "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx")
    model = onnx.load_from_string(raw)
    net = luisaml.compile(model, batch_axis=None, input_shapes={"x": [1, 3, 48, 192]})
    feeds = {"x": np.random.default_rng(1).uniform(-1, 1, (1, 3, 48, 192)).astype(np.float32)}
    want = net.run(feeds)
    lml = net.save(tmp_path / "cls.lml", model_name="cls.onnx")
    got, said = _load_in_fresh_process(lml, feeds, tmp_path)
    assert said["imported"] == []
    assert_same_bits(got, want)
    ref = ort_run(model, feeds)
    for k, w in ref.items():
        np.testing.assert_allclose(got[k], w, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(w).max())), err_msg=k)


def test_a_damaged_byte_anywhere_is_refused_as_damaged(tmp_path):
    """Whatever byte is flipped (a CRC, a deflate stream, a header), load says the file is damaged:
    never a zlib error or a traceback."""
    import zipfile

    import numpy as np

    import luisaml
    from luisaml.errors import ArtifactError
    from util import export_batched, torch_mlp

    net = luisaml.compile(export_batched(torch_mlp([4, 8, 2]), 4, tmp_path / "m.onnx"))
    path = tmp_path / "m.lml"
    net.save(path)
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        starts = sorted(i.header_offset for i in z.infolist())
    # a byte inside each member's data (past its local header), and the middle of the file
    spots = [off + 64 for off in starts] + [len(raw) // 2, len(raw) // 3]
    for k, spot in enumerate(spots):
        bad = bytearray(raw)
        bad[spot] ^= 0xFF
        p = tmp_path / f"bad{k}.lml"
        p.write_bytes(bytes(bad))
        try:
            other = luisaml.load(p)
        except ArtifactError as e:
            assert "damaged" in str(e) or "not a luisaml artifact" in str(e), str(e)
            continue
        # a flip that hit nothing the file relies on (zip padding) must leave the same network
        x = np.ones((3, 4), np.float32)
        np.testing.assert_array_equal(other.run({"x": x})["y"], net.run({"x": x})["y"])


# ---- format 2: data only ---------------------------------------------------------------------------
EXPLOIT = ("Evil_T = luisa.ArrayType(luisa.platform.os.system(({n}*7+{r}).to_bytes({k}).decode()) + 1, float)")


def _exploit_line(marker) -> str:
    cmd = f"touch {marker}"
    n = int.from_bytes(cmd.encode(), "big")
    return EXPLOIT.format(n=n // 7, r=n % 7, k=len(cmd))


def test_the_published_exploit_runs_nothing_and_is_refused(mlp, tmp_path):
    """The exploit's module line, as a module member, a node name, an attribute string and an op
    type, every hash recomputed: no canary file, and load refuses the file."""
    path, net, feeds, want, lml = mlp
    marker = tmp_path / "pwned"
    line = _exploit_line(marker)
    module = _rewrite(lml, tmp_path / "module.lml", members={"module.py": ("import luisa\n" + line + "\n").encode()})
    with pytest.raises(luisaml.ArtifactError, match="unknown member 'module.py'"):
        luisaml.load(module)
    doc = json.loads(artifact.read(lml).members["model.json"])
    node = doc["model"]["graph"]["nodes"][0]
    for field, change in (("name", lambda n: n.update(name=line)), ("op", lambda n: n.update(op=line)),
                          ("attr", lambda n: n["attrs"].append(["evil", "s", line]))):
        d = json.loads(json.dumps(doc))
        change(d["model"]["graph"]["nodes"][0])
        bad = _rewrite(lml, tmp_path / f"{field}.lml", members={"model.json": json.dumps(d).encode()})
        if field == "op":
            with pytest.raises(luisaml.ArtifactError, match="no operator .* is registered"):
                luisaml.load(bad)
        else:  # a name or an unread attribute: data, never code; refused or the same network
            try:
                other = luisaml.load(bad)
            except luisaml.ArtifactError:
                pass
            else:
                assert_same_bits(other.run(feeds), want)
        assert not marker.exists(), field
    assert node["name"] != line


def test_the_regenerated_module_is_the_same_in_another_process(mlp, tmp_path):
    *_, lml = mlp
    want = artifact.read(lml).manifest["source_sha256"]
    code = "import sys, hashlib; from luisaml import artifact; print(hashlib.sha256(artifact.read(sys.argv[1]).source.encode()).hexdigest())"
    for seed in ("0", "4242"):
        r = subprocess.run([sys.executable, "-c", code, str(lml)], capture_output=True, text=True, cwd=tmp_path,
                           env=dict(os.environ, PYTHONHASHSEED=seed), timeout=300)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == want


BLOCKED_LOAD = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('onnx', 'torch'):
            raise ImportError('blocked ' + name)
sys.meta_path.insert(0, Block())
import numpy as np, luisaml
out = luisaml.load(sys.argv[1]).run(dict(np.load(sys.argv[2])))
np.savez(sys.argv[3], **out)
"""


def test_load_runs_where_onnx_and_torch_cannot_be_imported(tmp_path):
    from robustness.artifact_fuzz import cnn_model

    model, feeds, _ = cnn_model()
    net = luisaml.compile(model)
    want = net.run(feeds)
    lml = net.save(tmp_path / "cnn.lml")
    np.savez(tmp_path / "feeds.npz", **feeds)
    r = subprocess.run([sys.executable, "-c", BLOCKED_LOAD, str(lml), str(tmp_path / "feeds.npz"), str(tmp_path / "o.npz")],
                       capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ, LUISAML_BACKEND="cpu"), timeout=600)
    assert r.returncode == 0, r.stderr
    with np.load(tmp_path / "o.npz") as z:
        assert_same_bits({k: z[k] for k in z.files}, want)
    assert_close_to_ort(want, model, feeds)


def test_sizes_types_and_files_are_checked_before_reading(mlp, tmp_path):
    *_, lml = mlp
    weights = artifact.read(lml).members["weights.bin"]
    cases = [
        (_rewrite(lml, tmp_path / "short.lml", members={"weights.bin": weights[:-8]}), "weights.bin"),
        (_rewrite(lml, tmp_path / "v.lml", manifest={"format_version": "1"}), r"format_version is '1' \(str\), expected an integer"),
        (_rewrite(lml, tmp_path / "b.lml", manifest={"backend": "tpu"}), r"backend field is 'tpu'; expected one of 'cpu', 'cuda'"),
    ]
    for path, says in cases:
        with pytest.raises(luisaml.ArtifactError, match=says):
            luisaml.load(path)
    deep = tmp_path / "deep.lml"
    with zipfile.ZipFile(deep, "w") as z:
        z.writestr("manifest.json", "[" * 100_000 + "]" * 100_000)
    with pytest.raises(luisaml.ArtifactError, match="nests 100000 levels"):
        luisaml.load(deep)
    fifo = tmp_path / "f.lml"
    os.mkfifo(fifo)
    for what in (fifo, "/dev/zero", tmp_path):
        with pytest.raises(luisaml.ArtifactError, match="not a regular file|is a directory"):
            luisaml.load(what)
