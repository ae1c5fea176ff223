"""The register allocator: live ranges -> in-place and view merges -> interference -> colouring.

Input is the schedule (one Step per node, in execution order) and the tensors to place; output is
an Allocation: which slot each tensor uses, each slot's size, and a report. Everything iterates
in a fixed order, so the same model always gives the same plan."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Request:
    """A tensor that needs storage: its pool (space and dtype) and element count."""

    name: str
    space: str  # "local" (registers) or "scratch" (device memory)
    dtype: str
    size: int
    itemsize: int


@dataclass
class Step:
    """One scheduled node: what it reads and writes, and which outputs may reuse which inputs."""

    label: str
    reads: list[str]
    writes: list[str]
    inplace: list[tuple[str, str]] = field(default_factory=list)  # (output, input): same index only
    views: list[tuple[str, str]] = field(default_factory=list)  # (output, input): same elements


@dataclass
class Slot:
    """One pooled array: its pool, size in elements, and the tensors that share it."""

    id: int
    space: str
    dtype: str
    size: int
    itemsize: int
    members: list[str]

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize


@dataclass
class Allocation:
    """The plan: slot of every placed tensor, the slots, and what was merged."""

    slots: list[Slot]
    slot_of: dict[str, int]
    live: dict[str, tuple[int, int]]  # tensor -> (first step, last step), inclusive
    inplace: list[tuple[str, str]]
    views: list[tuple[str, str]]
    bytes_unpooled: int

    @property
    def bytes_pooled(self) -> int:
        return sum(s.nbytes for s in self.slots)

    def report(self) -> str:
        """Return a human-readable table of the plan."""
        lines = [
            f"{len(self.slots)} slot{'' if len(self.slots) == 1 else 's'}, {self.bytes_pooled} bytes "
            f"(one array per tensor: {self.bytes_unpooled} bytes); "
            f"{len(self.inplace)} in-place, {len(self.views)} views"
        ]
        for s in self.slots:
            lines.append(f"  slot {s.id}: {s.space} {s.dtype}[{s.size}] <- {', '.join(s.members)}")
        return "\n".join(lines)


class _Groups:
    """Union-find over tensor names; the root holds the merged live range."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        root = x
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        while x != root:  # path compression
            self.parent[x], x = root, self.parent.get(x, x)
        return root

    def union(self, keep: str, other: str) -> None:
        self.parent[self.find(other)] = self.find(keep)


def live_ranges(steps: list[Step], names: set[str]) -> dict[str, tuple[int, int]]:
    """Return (first, last) step of each named tensor: written at first, last read at last."""
    live: dict[str, list[int]] = {}
    for k, st in enumerate(steps):
        for n in st.writes:
            if n in names:
                live.setdefault(n, [k, k])
        for n in st.reads:
            if n in names:
                r = live.setdefault(n, [k, k])
                r[1] = max(r[1], k)
    return {n: (a, b) for n, (a, b) in live.items()}


def allocate(steps: list[Step], requests: list[Request]) -> Allocation:
    """Return the slot plan for `requests` over the schedule `steps`."""
    req = {r.name: r for r in requests}
    live = live_ranges(steps, set(req))
    for r in requests:
        live.setdefault(r.name, (0, 0))
    groups = _Groups()
    span = {n: list(live[n]) for n in req}  # per root
    size = {n: req[n].size for n in req}
    merged_inplace: list[tuple[str, str]] = []
    merged_views: list[tuple[str, str]] = []

    def same_pool(a: str, b: str) -> bool:
        return (req[a].space, req[a].dtype) == (req[b].space, req[b].dtype)

    def merge(out: str, inp: str) -> None:
        ro, ri = groups.find(out), groups.find(inp)
        groups.union(ri, ro)
        span[ri] = [min(span[ri][0], span[ro][0]), max(span[ri][1], span[ro][1])]
        size[ri] = max(size[ri], size[ro])

    for k, st in enumerate(steps):
        for out, inp in st.views:
            if out in req and inp in req and same_pool(out, inp) and groups.find(out) != groups.find(inp):
                merge(out, inp)
                merged_views.append((out, inp))
        for out, inp in st.inplace:
            if out not in req or inp not in req or not same_pool(out, inp):
                continue
            ri, ro = groups.find(inp), groups.find(out)
            # the input's whole group must be dead after this step, and the output not yet merged
            # (an output that took one dying input's storage must not take a second one's too)
            if ri == ro or ro != out or span[ri][1] != k or req[out].size > size[ri]:
                continue
            if any(groups.find(o) == ri for o in st.writes if o != out and o in req):
                continue
            merge(out, inp)
            merged_inplace.append((out, inp))

    roots = sorted({groups.find(n) for n in req}, key=lambda r: (-size[r], span[r][0], span[r][1], r))
    slots: list[Slot] = []
    slot_roots: list[list[str]] = []
    root_slot: dict[str, int] = {}
    for r in roots:
        pool = (req[r].space, req[r].dtype)
        best, best_growth = None, None
        for s in slots:
            if (s.space, s.dtype) != pool:
                continue
            if any(_overlap(span[r], span[o]) for o in slot_roots[s.id]):
                continue
            growth = max(0, size[r] - s.size)
            if best is None or growth < best_growth:
                best, best_growth = s, growth
        if best is None:
            best = Slot(len(slots), pool[0], pool[1], 0, req[r].itemsize, [])
            slots.append(best)
            slot_roots.append([])
        best.size = max(best.size, size[r])
        slot_roots[best.id].append(r)
        root_slot[r] = best.id
    slot_of = {n: root_slot[groups.find(n)] for n in req}
    for n in req:  # members in schedule order
        slots[slot_of[n]].members.append(n)
    unpooled = sum(r.size * r.itemsize for r in requests)
    return Allocation(slots, slot_of, live, merged_inplace, merged_views, unpooled)


def _overlap(a, b) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]
