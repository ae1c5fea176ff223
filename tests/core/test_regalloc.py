"""The register allocator: safety on random DAGs, the MLP plan, determinism."""
import random

import numpy as np
import pytest
import torch

import luisaml
from luisaml.regalloc import Request, Step, allocate


def _random_dag(seed: int):
    rng = random.Random(seed)
    n = rng.randint(3, 40)
    names = [f"t{k}" for k in range(n)]
    steps, requests = [], []
    for k, name in enumerate(names):
        reads = rng.sample(names[:k], min(k, rng.randint(0, 3))) if k else []
        st = Step(f"n{k}", reads, [name])
        same = [r for r in reads if rng.random() < 0.5]
        st.inplace = [(name, r) for r in same]
        if reads and rng.random() < 0.2:
            st.views = [(name, reads[0])]
            st.inplace = []
        steps.append(st)
        requests.append(Request(name, "local", rng.choice(["float", "int"]), rng.randint(1, 64), 4))
    # a few tensors outlive the graph (read by a final step)
    steps.append(Step("outputs", rng.sample(names, min(n, 3)), []))
    return steps, requests


@pytest.mark.parametrize("seed", range(300))
def test_no_two_live_tensors_share_storage(seed):
    steps, requests = _random_dag(seed)
    plan = allocate(steps, requests)
    by_name = {r.name: r for r in requests}
    merged = {frozenset(p) for p in plan.inplace + plan.views}
    # two tensors of one slot never hold values at the same time, unless merged by design
    # (a view is the same elements; in-place writes element i after reading element i)
    groups = {}
    for a, b in plan.inplace + plan.views:
        groups.setdefault(a, set()).add(b)
        groups.setdefault(b, set()).add(a)

    def related(a, b):  # transitively merged
        seen, todo = {a}, [a]
        while todo:
            x = todo.pop()
            for y in groups.get(x, ()):
                if y not in seen:
                    seen.add(y)
                    todo.append(y)
        return b in seen

    for slot in plan.slots:
        assert slot.size >= max(by_name[m].size for m in slot.members)
        assert {by_name[m].dtype for m in slot.members} == {slot.dtype}
        for i, a in enumerate(slot.members):
            for b in slot.members[i + 1:]:
                la, lb = plan.live[a], plan.live[b]
                overlap = la[0] <= lb[1] and lb[0] <= la[1]
                if overlap:
                    assert related(a, b), f"{a}{la} and {b}{lb} share slot {slot.id} while both live"
    assert plan.bytes_pooled <= plan.bytes_unpooled
    assert allocate(steps, requests).slot_of == plan.slot_of  # deterministic


def test_inplace_only_when_input_dies():
    steps = [Step("a", [], ["x"]), Step("relu", ["x"], ["y"], inplace=[("y", "x")]), Step("use", ["x", "y"], ["z"])]
    reqs = [Request(n, "local", "float", 8, 4) for n in "xyz"]
    plan = allocate(steps, reqs)
    assert plan.inplace == []
    assert plan.slot_of["x"] != plan.slot_of["y"]


def _export_mlp(path, widths):
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    m = torch.nn.Sequential(*layers[:-1])
    torch.onnx.export(m, (torch.randn(2, widths[0]),), path, dynamo=False, input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "B"}, "y": {0: "B"}}, opset_version=17)


def test_mlp_plan_has_two_slots(tmp_path):
    _export_mlp(tmp_path / "mlp.onnx", [8, 32, 64, 32, 4])
    plan = luisaml.runtime.analyze(tmp_path / "mlp.onnx")
    alloc = plan.allocation
    assert len(alloc.slots) == 2, alloc.report()
    assert len(alloc.inplace) == 3  # each Relu writes over its Gemm's output
    assert alloc.bytes_pooled == (64 + 32) * 4  # h2 alone; h1 and h3 share the other slot
    assert alloc.bytes_unpooled == (32 + 32 + 64 + 64 + 32 + 32) * 4
    assert "2 slots" in alloc.report()
