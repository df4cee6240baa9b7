"""The serving process's objects and Python's cyclic garbage collector.

While the app serves, the objects that exist once it has started (its modules, routes,
schemas: about 200,000) are kept out of cyclic garbage collection (:func:`gc.freeze`).
Otherwise each full collection scans them all, a pause of a tenth of a second on a small
machine that the request waiting on it pays: the slowest budget reads and admissions
(``bench/ledger_reads.py``). So whatever the service loads later must be frozen too: planning's
PLD code is imported before the freeze (:func:`frozen`), and torch, which only registering a
dataset needs, is frozen as it is imported (:func:`frozen_imports`)."""

from __future__ import annotations

import gc
import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager

#: what planning imports on its first use: dp-accounting's PLD code and the scipy it pulls in,
#: for a fixed-K job's PLD statement and a ps job's privacy profile
#: (:mod:`core.accounting.profile`). The accounting package leaves it out of its own import (the
#: workers never need it); the service needs it for its first plan.
PLANNING_MODULES = ("dp_accounting.pld.privacy_loss_distribution",)


@contextmanager
def frozen() -> Iterator[None]:
    """While inside, every object that exists at entry is in the permanent generation
    (:data:`PLANNING_MODULES` imported first); at exit they go back to the collector."""
    for name in PLANNING_MODULES:
        importlib.import_module(name)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def frozen_imports() -> Iterator[None]:
    """Imports inside this block that load modules, once the app has frozen its objects, are
    frozen with them: the modules' objects live as long as the process, and left to the
    collector they would lengthen every full collection after."""
    loaded = len(sys.modules)
    yield
    # the count of frozen objects walks them all: asked only once something was loaded
    if len(sys.modules) > loaded and gc.get_freeze_count():
        gc.freeze()
