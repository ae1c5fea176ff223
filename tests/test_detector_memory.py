"""benchmarks/detector_memory.py cannot rot: on the quick frames, in its own process, with the device grid
builds CUDA runs, every byte counts hold is owned by a buffer it tracks, and the builds' scratch is one
shared buffer (luisaml/pool.py SharedBuffers)."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_breakdown_accounts_for_every_held_byte():
    out = subprocess.run([sys.executable, "-P", str(ROOT / "benchmarks" / "detector_memory.py"), "--quick",
                          "--grid-build", "device"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    held, tracked = (int(x.replace(",", "")) for x in re.search(r"held ([\d,]+) bytes; tracked ([\d,]+)", out.stdout).groups())
    assert held == tracked > 0
    assert re.search(r"^\s*[\d,]+  grid builds \(shared\): stage slots, scratch$", out.stdout, re.M), out.stdout
    assert len(re.findall(r"^\s*[\d,]+  scratch_int  \(grid build\)$", out.stdout, re.M)) == 1, out.stdout
