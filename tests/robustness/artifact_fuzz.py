"""The artifact fuzzer: built .lml files (an MLP, a small CNN, a model with an If) mutated member by
member, field by field and in their zip structure, with and without the hashes made to match
again, and loaded. For each case `luisaml.load` must either raise a luisaml.LuisamlError or return
a network whose outputs equal the unmutated artifact's (or, for a change of weight or attribute
values with every hash recomputed, a file that is a consistent description of another model: any
outputs of the right shapes); never another exception type, never past the case's time bound,
never run code: strings carrying Python (the published exploit's line among them) are put into
every string field, with every hash recomputed including the module's, and a marker file only that
code could create must never appear.

    python -m tests.robustness.artifact_fuzz            # the CI sample (~300 cases)
    python -m tests.robustness.artifact_fuzz --full     # every model x 1,500 seeds

The cases run in this process one after another, each under a timer (a case past it fails);
tests/robustness/test_artifact_fuzz.py runs the sample in a child process, so that an abort or a
hang in native code fails the test rather than the session. Needs onnx to build the models; the
loads themselves never import it."""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import random
import signal
import struct
import sys
import tempfile
import time
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CI_SEEDS = 100  # per model: 300 cases
FULL_SEEDS = 1500  # per model: 4,500 cases
CASE_SECONDS = 30.0


# ---- the models ---------------------------------------------------------------------------------
def _model(nodes, inputs, outputs, inits, opset=17):
    from onnx import helper, numpy_helper

    g = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def mlp_model():
    """A batched two-layer MLP (Gemm, Relu, Gemm): (model, feeds, compile options)."""
    from onnx import TensorProto, helper

    r = np.random.default_rng(0)
    inits = {"w1": r.standard_normal((8, 16)).astype(np.float32), "b1": r.standard_normal(16).astype(np.float32),
             "w2": r.standard_normal((16, 3)).astype(np.float32), "b2": r.standard_normal(3).astype(np.float32)}
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1"),
             helper.make_node("Relu", ["h"], ["a"], name="relu"),
             helper.make_node("Gemm", ["a", "w2", "b2"], ["y"], name="fc2")]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], inits)
    return m, {"x": r.standard_normal((5, 8)).astype(np.float32)}, {}


def cnn_model():
    """A small batched CNN (Conv, Relu, MaxPool, Flatten, Gemm, Softmax) on 1x12x12 images."""
    from onnx import TensorProto, helper

    r = np.random.default_rng(1)
    inits = {"k": (r.standard_normal((4, 1, 3, 3)) * 0.5).astype(np.float32), "kb": r.standard_normal(4).astype(np.float32),
             "w": (r.standard_normal((100, 5)) * 0.1).astype(np.float32), "b": r.standard_normal(5).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", "k", "kb"], ["c"], name="conv", pads=[0, 0, 0, 0]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Flatten", ["p"], ["f"], name="flat", axis=1),
             helper.make_node("Gemm", ["f", "w", "b"], ["z"], name="fc"),
             helper.make_node("Softmax", ["z"], ["y"], name="softmax", axis=1)]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 12, 12])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])], inits)
    return m, {"x": r.standard_normal((3, 1, 12, 12)).astype(np.float32)}, {}


def if_model():
    """A model whose If picks a branch per run from the sign of a sum (fixed shapes)."""
    from onnx import TensorProto, helper, numpy_helper

    def branch(name, op, const):
        c = numpy_helper.from_array(np.array(const, np.float32), f"{name}_c")
        return helper.make_graph([helper.make_node(op, ["x", f"{name}_c"], [f"{name}_y"], name=f"{name}_op")], name, [],
                                 [helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT, [3])], [c])

    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0, name="sum"),
             helper.make_node("Greater", ["s", "zero"], ["c"], name="greater"),
             helper.make_node("If", ["c"], ["y"], name="if", then_branch=branch("then", "Add", [10, 20, 30]),
                              else_branch=branch("else", "Mul", [-1, 0.5, 2]))]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])], {"zero": np.float32(0)})
    return m, {"x": np.array([1.0, -0.5, 0.25], np.float32)}, {"batch_axis": None}


MODELS = {"mlp": mlp_model, "cnn": cnn_model, "if": if_model}


# ---- the payloads --------------------------------------------------------------------------------
def payloads(marker: str) -> list[str]:
    """Strings that create `marker` if any of them ever runs as Python: the published exploit's
    module line (its command built from integer arithmetic), statements after a line break, and
    the same through the names the generated module may use."""
    cmd = f"touch {marker}"
    n = int.from_bytes(cmd.encode(), "big")
    return [
        f"Evil_T = luisa.ArrayType(luisa.platform.os.system(({n // 7}*7+{n % 7}).to_bytes({len(cmd)}).decode()) + 1, float)",
        f"x\n__import__('pathlib').Path({marker!r}).touch()\n",
        f"x\rimport pathlib; pathlib.Path({marker!r}).touch()",
        f"x\u2028luisa.inspect.builtins.exec(\"open({marker!r},'w')\")",
        f"'''\nopen({marker!r}, 'w')\n'''",
        f"{{{{ open({marker!r}, 'w') }}}}",  # (a template expression, were a name ever rendered as one)
    ]


# ---- an artifact as data, and back ---------------------------------------------------------------
@dataclass
class Parts:
    """An artifact's manifest and members, in zip order."""

    manifest: dict
    members: dict[str, bytes]

    @staticmethod
    def read(path) -> "Parts":
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            manifest = json.loads(z.read("manifest.json"))
            return Parts(manifest, {n: z.read(n) for n in names if n != "manifest.json"})

    def copy(self) -> "Parts":
        return Parts(json.loads(json.dumps(self.manifest)), dict(self.members))

    def rehash(self, source: bool = False) -> None:
        """Make the member hashes, the content hash and (source=True) the module's hash match again:
        everything a tamperer can recompute."""
        from luisaml import artifact

        self.manifest["members"] = {k: {"sha256": hashlib.sha256(v).hexdigest(), "bytes": len(v)}
                                    for k, v in self.members.items() if k != "manifest.json"}
        if source:
            try:
                doc = json.loads(self.members["model.json"])
                plan = artifact.regenerate(doc, self.members["weights.bin"], "(fuzz)")
                self.manifest["source_sha256"] = hashlib.sha256(plan.source.encode()).hexdigest()
            except Exception:  # (data that does not build: load refuses it, which the case then checks)
                pass
        self.manifest["content_hash"] = artifact.content_hash(self.manifest)

    def write(self, path, order=None, manifest_raw: bytes | None = None) -> None:
        raw = manifest_raw if manifest_raw is not None else json.dumps(self.manifest).encode()
        entries = [("manifest.json", raw)] + list(self.members.items())
        if order is not None:
            entries = [entries[i] for i in order]
        with zipfile.ZipFile(path, "w") as z:
            for k, v in entries:
                z.writestr(k, v, zipfile.ZIP_STORED if k == "weights.bin" else zipfile.ZIP_DEFLATED)


def _paths(obj, prefix=()):
    """Yield the path of every value in a JSON document."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _get(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def _set(obj, path, value):
    if not path:
        return value
    _get(obj, path[:-1])[path[-1]] = value
    return obj


def _odd_values(rng: random.Random, old, marker_strings):
    """A replacement for a JSON value: another type, a number off by a little or a lot, a string
    carrying code, a deep nest."""
    choices = [None, True, 0, -1, 1, 2**31, 2**40, 2**63, -(2**63) - 1, 1.5, float("1e308"), "", "1", "x" * 1000,
               [], {}, [1, 2, 3], {"a": 1}, rng.choice(marker_strings), "\udc80", [[[[[[[[]]]]]]]]]
    if isinstance(old, bool):
        choices += [not old]
    elif isinstance(old, int):
        choices += [old + 1, old - 1, old * 2, old * 1000, -old, str(old)]
    elif isinstance(old, str):
        choices += [old + "x", old.upper(), old[:-1], str(len(old))]
    elif isinstance(old, list):
        choices += [old[:-1], old + old[-1:], list(reversed(old))]
    return rng.choice(choices)


# ---- the mutations -------------------------------------------------------------------------------
# each returns (label, expect, writer): expect "same" (a load that succeeds must give the unmutated
# outputs) or "any" (a consistent file of another model: outputs of the right shapes)
def mutate(parts: Parts, rng: random.Random, marker: str):
    strings = payloads(marker)
    p = parts.copy()
    kind = rng.choice(["member_bytes", "member_size", "members", "manifest", "model", "model", "model", "weights",
                       "zip", "inject", "noop"])
    rehash = rng.random() < 0.7
    expect = "same"
    label = kind
    manifest_raw = None
    order = None
    if kind == "member_bytes":
        name = rng.choice(sorted(p.members))
        raw = bytearray(p.members[name])
        if raw:
            for _ in range(rng.choice([1, 1, 2, 8])):
                raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        p.members[name] = bytes(raw)
        label = f"flip {name}"
        expect = "any" if name == "weights.bin" and rehash else "same"
    elif kind == "member_size":
        name = rng.choice(sorted(p.members))
        raw = p.members[name]
        how = rng.choice(["cut", "cut1", "grow", "grow16", "empty"])
        p.members[name] = {"cut": raw[: len(raw) // 2], "cut1": raw[:-1], "grow": raw + b"\0" * rng.randrange(1, 64),
                           "grow16": raw + b"\0" * 16, "empty": b""}[how]
        label = f"{how} {name}"
    elif kind == "members":
        how = rng.choice(["drop", "extra", "module", "rename"])
        if how == "drop":
            name = rng.choice(sorted(p.members))
            del p.members[name]
            label = f"drop {name}"
        elif how == "extra":
            p.members[rng.choice(["const/0.npy", "x.bin", "../evil", "model.json/"])] = b"data"
        elif how == "module":
            p.members["module.py"] = ("import luisa\n" + strings[0] + "\n").encode()
        else:
            name = rng.choice(sorted(p.members))
            p.members[name.upper()] = p.members.pop(name)
        label = f"members {how}"
    elif kind == "manifest":
        path = rng.choice(list(_paths(p.manifest)))
        new = _odd_values(rng, _get(p.manifest, path), strings)
        p.manifest = _set(p.manifest, path, new) if path else new
        label = f"manifest {'.'.join(map(str, path))} = {str(new)[:40]!r}"
        rehash = rehash and isinstance(p.manifest, dict)
        if rehash and path and path[0] in ("created", "model"):  # (what the network is made of is unchanged)
            expect = "same"
    elif kind in ("model", "weights"):
        doc = json.loads(p.members["model.json"])
        if kind == "weights" and doc["arrays"]:
            k = rng.randrange(len(doc["arrays"]))
            path = ("arrays", k, rng.choice(["dtype", "shape", "offset"]))
        else:
            path = rng.choice(list(_paths(doc)))
        old = _get(doc, path)
        new = _odd_values(rng, old, strings)
        doc = _set(doc, path, new) if path else new
        p.members["model.json"] = json.dumps(doc).encode()
        label = f"model.json {'.'.join(map(str, path))}: {str(old)[:30]!r} -> {str(new)[:40]!r}"
        # with every hash recomputed a change of a value is another model, consistently described
        expect = "any" if rehash and _is_value(path) else "same"
        if rehash and expect == "any":
            p.rehash(source=True)
            return label, expect, lambda f: p.write(f)
    elif kind == "zip":
        how = rng.choice(["truncate", "dup", "order", "huge", "garbage", "deep", "nan"])
        label = f"zip {how}"
        if how == "order":
            n = len(p.members) + 1
            order = list(range(n))
            rng.shuffle(order)
            if order == list(range(n)):
                order = list(reversed(order))
        elif how == "deep":
            manifest_raw = b"[" * 100_000 + b"]" * 100_000
        elif how == "nan":
            manifest_raw = json.dumps({**p.manifest, "format_version": float("nan")}).encode()
        if rehash:
            p.rehash()
        return label, expect, lambda f: _zip_damage(p, f, how, rng, order, manifest_raw)
    elif kind == "inject":
        # every string field of model.json and the manifest carries code; every hash recomputed
        doc = json.loads(p.members["model.json"])
        payload = rng.choice(strings)
        touched = 0
        for path in list(_paths(doc)):
            v = _get(doc, path)
            if isinstance(v, str) and rng.random() < 0.5:
                _set(doc, path, v + payload if rng.random() < 0.5 else payload)
                touched += 1
        p.members["model.json"] = json.dumps(doc).encode()
        p.manifest["model"] = payload
        p.rehash(source=True)
        return f"inject into {touched} strings", "any", lambda f: p.write(f)
    else:  # a no-op: the report rewritten, the manifest's keys reordered, the zip written again
        how = rng.choice(["rewrite", "created", "report"])
        if how == "created":
            p.manifest["created"] = "2020-01-01T00:00:00+00:00"
        elif how == "report" and "report.json" in p.members:
            p.members["report.json"] = json.dumps(json.loads(p.members["report.json"]), indent=4).encode()
        p.rehash()
        return f"noop {how}", "same", lambda f: p.write(f)
    if rehash:
        p.rehash()
    label += " (rehashed)" if rehash else ""
    return label, expect, lambda f: p.write(f, order, manifest_raw)


def _is_value(path) -> bool:
    """Whether a model.json path holds a value of the model rather than its structure: an attribute's
    value, a batch annotation's number."""
    return (len(path) >= 2 and path[-2] == 2 and "attrs" in path) or path[-1:] == ("value",)


def _zip_damage(p: Parts, path, how, rng: random.Random, order, manifest_raw) -> None:
    p.write(path, order, manifest_raw)
    raw = bytearray(Path(path).read_bytes())
    if how == "truncate":
        raw = raw[: rng.randrange(len(raw))]
    elif how == "dup":
        with zipfile.ZipFile(path, "a") as z:
            name = rng.choice(["manifest.json", "model.json", "weights.bin"])
            z.writestr(name, b"{}")
        return
    elif how == "huge":
        # a member declaring 1.84 GiB (central directory and local header both), the file unchanged
        at = raw.find(b"PK\x01\x02", rng.randrange(len(raw) // 2))
        at = raw.find(b"PK\x01\x02") if at < 0 else at
        struct.pack_into("<I", raw, at + 24, 0x75E00000)
        local = struct.unpack_from("<I", raw, at + 42)[0]
        struct.pack_into("<I", raw, local + 22, 0x75E00000)
    elif how == "garbage":
        at = rng.randrange(len(raw))
        raw[at:at + 8] = os.urandom(8)
    Path(path).write_bytes(bytes(raw))


# ---- running -------------------------------------------------------------------------------------
class _Timeout(BaseException):
    pass


def _alarm(signum, frame):
    raise _Timeout()


@dataclass
class Outcome:
    case: str
    result: str  # "refused", "same", "other model", or a FAIL_ class
    detail: str = ""


def build(name: str, folder: Path):
    """Return (the .lml path, feeds, the outputs of the network loaded from it)."""
    import luisaml

    model, feeds, opts = MODELS[name]()
    net = luisaml.compile(model, **opts)
    lml = net.save(folder / f"{name}.lml", model_name=name)
    return lml, feeds, luisaml.load(lml).run(feeds)


def run(models, seeds, folder: Path, seed0: int = 0, quiet: bool = False) -> list[Outcome]:
    """Run seeds x models cases in this process; return their outcomes."""
    import luisaml
    from luisaml.errors import LuisamlError

    marker = folder / "CANARY"
    signal.signal(signal.SIGALRM, _alarm)
    out: list[Outcome] = []
    for name in models:
        lml, feeds, want = build(name, folder)
        parts = Parts.read(lml)
        for seed in range(seed0, seed0 + seeds):
            rng = random.Random(f"{name}/{seed}")
            case = f"{name}/{seed}"
            target = folder / f"case-{name}-{seed}.lml"
            label = "?"
            try:
                label, expect, write = mutate(parts, rng, str(marker))
                write(target)
            except Exception as e:  # (a bug of this fuzzer, not of luisaml)
                out.append(Outcome(case, "FAIL_HARNESS", f"{label}: {type(e).__name__}: {e}"))
                continue
            case = f"{case} [{label}]"
            t = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
            try:
                net = luisaml.load(target)
                got = net.run(feeds)
                if set(got) != set(want):
                    res = Outcome(case, "FAIL_WRONG", f"outputs {sorted(got)}, expected {sorted(want)}")
                elif all(got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes() for k in want):
                    res = Outcome(case, "same")
                elif expect == "any" and all(got[k].shape == want[k].shape for k in want):
                    res = Outcome(case, "other model")
                else:
                    res = Outcome(case, "FAIL_WRONG", "loaded an inconsistent file and answered differently")
            except _Timeout:
                res = Outcome(case, "FAIL_HANG", f"past {CASE_SECONDS} s")
            except LuisamlError as e:
                res = Outcome(case, "refused", f"{type(e).__name__}: {str(e)[:300]}")
            except Exception as e:
                res = Outcome(case, "FAIL_ERROR", f"{type(e).__name__}: {str(e)[:300]}")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            if marker.exists():
                res = Outcome(case, "FAIL_INJECTION", f"the marker file was created ({res.result}: {res.detail})")
                marker.unlink()
            res.detail += f" ({time.perf_counter() - t:.2f} s)"
            out.append(res)
            target.unlink(missing_ok=True)
            if not quiet and res.result.startswith("FAIL"):
                print(f"{res.result} {res.case}: {res.detail}", flush=True)
    return out


def summary(outcomes: list[Outcome]) -> str:
    counts = Counter(o.result for o in outcomes)
    return f"{len(outcomes)} cases: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.robustness.artifact_fuzz", description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help=f"{FULL_SEEDS} seeds per model (default {CI_SEEDS})")
    ap.add_argument("--seeds", type=int, help="seeds per model")
    ap.add_argument("--seed0", type=int, default=0)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--report", help="write every outcome to this JSON file")
    a = ap.parse_args(argv)
    os.environ.setdefault("LUISAML_BACKEND", "cpu")
    seeds = a.seeds or (FULL_SEEDS if a.full else CI_SEEDS)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="luisaml-artifact-fuzz-") as d:
        outcomes = run(a.models.split(","), seeds, Path(d), a.seed0)
    line = summary(outcomes) + f" in {time.perf_counter() - t0:.0f} s"
    print(line)
    if a.report:
        Path(a.report).write_text(json.dumps([o.__dict__ for o in outcomes], indent=1))
    return 1 if any(o.result.startswith("FAIL") for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
