"""``bench/step_overhead.py --quick`` runs in CI-sized time: one model, the columns that differ
in kind (non-private, per-sample, fast with either generator, Opacus), each in its own process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "step_overhead.py"
METHODS = ["general", "fast", "fast_torchrng", "opacus_ghost"]


def test_quick_benchmark(tmp_path: Path) -> None:
    out = tmp_path / "quick.json"
    # the interleaved rounds go on until the fastest column has spent --seconds, and each round
    # runs the slowest (materializing) column too: a short --seconds keeps the test short
    args = ["--quick", "--seconds", "0.05", "--models", "mlp", "--json", str(out)]
    args += ["--methods", *METHODS]
    done = subprocess.run(
        [sys.executable, str(BENCH), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fast" in done.stdout
    results = json.loads(out.read_text())
    rows = results if isinstance(results, list) else results["results"]
    assert {r["method"] for r in rows} == {"nonprivate", *METHODS}
    assert all(r["model"] == "mlp" and r["time_s"] > 0 and r["peak_mb"] > 0 for r in rows)
    assert all(r["code_mb"] >= 0 and r["first_peak_mb"] > 0 for r in rows)
    # time ratios from the columns taking turns in one process; the table shows them
    ratios = {r["method"]: r["time_ratio"] for r in rows}
    assert ratios["nonprivate"] == 1.0 and all(v > 0 for v in ratios.values())
    fast = next(line for line in done.stdout.splitlines() if line.startswith("| mlp"))
    assert f"{ratios['fast']:.2f}x / " in fast


LIBRARY_MB, TRANSIENT_MB = 8, 16


def test_peak_memory_counts_transients_not_library_pages(tmp_path: Path) -> None:
    """A step that maps 8 MB of a file (as a shared library's code is mapped on first use) and
    holds a 16 MB transient: its steady peak is the transient, its code pages are the file."""
    library = tmp_path / "library.bin"
    library.write_bytes(b"\1" * (LIBRARY_MB << 20))
    script = f"""
import json, mmap, sys
sys.path.insert(0, {str(BENCH.parent)!r})
import numpy as np
import step_overhead

handle = open({str(library)!r}, "rb")
pages = mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ)

np.ones({TRANSIENT_MB} << 20, dtype=np.uint8).sum()  # numpy's own code, mapped beforehand

def build():
    def step():
        sum(pages[i] for i in range(0, len(pages), mmap.PAGESIZE))
        np.ones({TRANSIENT_MB} << 20, dtype=np.uint8).sum()
    return step

_, memory = step_overhead.measure_memory(build, "cpu")
print(json.dumps(memory.__dict__))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    memory = json.loads(done.stdout)
    # the file, and whatever code the interpreter maps on first use (1.1 MB more in one CI run)
    assert LIBRARY_MB - 0.5 < memory["code_mb"] < LIBRARY_MB + 2
    assert TRANSIENT_MB - 0.5 < memory["peak_mb"] < TRANSIENT_MB + 1.5
    assert memory["first_peak_mb"] > LIBRARY_MB + TRANSIENT_MB - 0.5
