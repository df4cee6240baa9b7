"""dp-accounting's RDP accountant and its events, without the rest of the package.

``import dp_accounting`` runs the package's ``__init__``, which imports its PLD accountant and
its mechanism calibration, and with them SciPy's signal, stats and optimize modules: 0.7–0.9 s
in every process that accounts. A tuning job's driver and then its first trial process both
account before the job's first step, so that was 1.4–1.8 s of every job's start
(``bench/job_overhead.py``). Only :mod:`dp_accounting.dp_event` and
:mod:`dp_accounting.rdp.rdp_privacy_accountant` are used here, and neither needs those modules.

So the package enters ``sys.modules`` without its ``__init__`` having run
(:func:`_package_without_init`); its submodules import as usual, and the first use of anything
else of the package (``dp_accounting.RdpAccountant``, say) runs the ``__init__`` then, so code
that uses the whole package — the tests' cross-checks — gets all of it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from types import ModuleType


def _package_without_init(name: str) -> ModuleType:
    """``name``'s package module as importing it would make it, but its ``__init__`` not yet
    run: until then an attribute it lacks is imported as its submodule, or else the
    ``__init__`` runs and gives it. An already imported package is left as it is."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        raise ModuleNotFoundError(f"no package {name}", name=name)
    package, loader = importlib.util.module_from_spec(spec), spec.loader
    completing = threading.Lock()  # threads asking at once: the __init__ runs once

    def attribute(key: str) -> object:
        try:
            return importlib.import_module(f"{name}.{key}")
        except ModuleNotFoundError as error:
            if error.name != f"{name}.{key}":
                raise
        with completing:
            if "__getattr__" in vars(package):  # still until the __init__ has run
                loader.exec_module(package)
                delattr(package, "__getattr__")
        return getattr(package, key)

    setattr(package, "__getattr__", attribute)  # noqa: B010  (a module's own __getattr__)
    sys.modules[name] = package
    return package


_package_without_init("dp_accounting")

from dp_accounting import dp_event  # noqa: E402
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib  # noqa: E402

__all__ = ["dp_event", "rdp_lib"]
