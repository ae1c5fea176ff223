"""DESIGN.md's map matches the tree: every path its tables of places name exists."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _named_paths() -> list[str]:
    paths = []
    for line in (ROOT / "DESIGN.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        paths += [p for p in re.findall(r"`([^`]+)`", first) if "/" in p or p.startswith(".")]
    return paths


def test_design_names_only_paths_that_exist():
    paths = _named_paths()
    assert len(paths) > 20, "DESIGN.md's tables of places were not found"
    missing = [p for p in paths if not (ROOT / p.rstrip("/")).exists() and not list(ROOT.glob(p))]
    assert not missing, f"DESIGN.md names paths that do not exist: {missing}"
