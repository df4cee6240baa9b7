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
    args = ["--quick", "--models", "mlp", "--json", str(out), "--methods", *METHODS]
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
