"""``bench/step_overhead.py --quick`` runs in CI-sized time and measures every column."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "step_overhead.py"


def test_quick_benchmark(tmp_path: Path) -> None:
    out = tmp_path / "quick.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fast" in done.stdout
    results = json.loads(out.read_text())
    rows = results if isinstance(results, list) else results["results"]
    fast = [r for r in rows if r["method"] == "fast"]
    assert {r["model"] for r in fast} == {"mlp", "logreg"}
    assert all(r["time_s"] > 0 and r["peak_mb"] > 0 for r in fast)
