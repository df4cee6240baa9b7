"""``core.accounting`` loads dp-accounting's RDP modules without the rest of the package
(``core/accounting/library.py``), and code that wants the whole package still gets it.

Each check runs in a fresh interpreter: what a process has imported is the point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: what ``import dp_accounting`` used to load in every accounting process (0.7–0.9 s)
HEAVY = ["dp_accounting.pld", "dp_accounting.mechanism_calibration", "scipy.signal", "scipy.stats"]


def fresh(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON value, returned here."""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_accounting_loads_only_the_rdp_modules() -> None:
    got = fresh(
        "import json, sys\n"
        "from core.accounting import dpsgd_epsilon, tuning_method\n"
        "import runner.driver\n"
        f"print(json.dumps({{'loaded': [m for m in {HEAVY!r} if m in sys.modules],\n"
        "    'epsilon': dpsgd_epsilon(0.01, 1.1, 1000, 1e-5)}))"
    )
    assert got["loaded"] == []
    # the same number as the whole package computes (and as tests/accounting/test_rdp.py checks)
    whole = fresh(
        "import json, dp_accounting\n"
        "from core.accounting import dpsgd_epsilon\n"
        "print(json.dumps({'epsilon': dpsgd_epsilon(0.01, 1.1, 1000, 1e-5)}))"
    )
    assert got["epsilon"] == whole["epsilon"] > 0


def test_the_whole_package_is_there_for_who_asks() -> None:
    got = fresh(
        "import json, sys\n"
        "from core.accounting.library import dp_event\n"
        "import dp_accounting\n"
        "from dp_accounting import calibrate_dp_mechanism\n"
        "try:\n"
        "    dp_accounting.no_such_name\n"
        "    missing = None\n"
        "except AttributeError as error:\n"
        "    missing = str(error)\n"
        "print(json.dumps({\n"
        "    'same_events': dp_accounting.DpEvent is dp_event.DpEvent,\n"
        "    'pld': dp_accounting.pld.PLDAccountant.__name__,\n"
        "    'rdp': dp_accounting.rdp.RdpAccountant.__name__,\n"
        "    'calibrate': calibrate_dp_mechanism.__name__,\n"
        "    'missing': missing,\n"
        "    'getattr_left': '__getattr__' in vars(dp_accounting)}))"
    )
    assert got == {
        "same_events": True,
        "pld": "PLDAccountant",
        "rdp": "RdpAccountant",
        "calibrate": "calibrate_dp_mechanism",
        "missing": "module 'dp_accounting' has no attribute 'no_such_name'",
        "getattr_left": False,
    }


def test_a_package_imported_before_is_used_as_it_is() -> None:
    got = fresh(
        "import json, dp_accounting\n"
        "whole = dp_accounting.DpEvent\n"
        "from core.accounting.library import dp_event\n"
        "import dp_accounting as again\n"
        "print(json.dumps({'same': again is dp_accounting and dp_event.DpEvent is whole}))"
    )
    assert got == {"same": True}


def test_threads_asking_at_once_all_get_the_whole_package() -> None:
    got = fresh(
        "import json, threading\n"
        "import core.accounting\n"
        "import dp_accounting\n"
        "start, names, errors = threading.Barrier(8), [], []\n"
        "def ask():\n"
        "    start.wait()\n"
        "    try:\n"
        "        names.append(dp_accounting.NeighboringRelation.__name__)\n"
        "    except Exception as error:\n"
        "        errors.append(repr(error))\n"
        "threads = [threading.Thread(target=ask) for _ in range(8)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "print(json.dumps({'names': names, 'errors': errors}))"
    )
    assert got == {"names": ["NeighboringRelation"] * 8, "errors": []}
