"""Factories that probe where admission builds them (``service.own_models``): what the process
that imports this module can read of the service's secrets, and what becomes of the messages of
exceptions it raises. Importable as ``tests/models_pkg`` is on the path, as
``dptune_test_models`` is.
"""

from __future__ import annotations

import json
import math
import os
import time

import torch
from torch import nn

#: the environment's variable names when this module was imported
IMPORTED_WITH = sorted(os.environ)
#: what an exception of the operator's code might carry: a credential it could read
SECRET = "postgresql://dptune:hunter2-3b1f9c@db.internal/dptune"


def _linear(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


def environment(input_shape: tuple[int, ...], num_classes: int, record: str) -> nn.Module:
    """A linear model; writes to the file ``record`` the variable names of the environment it
    was imported and called in, and the values of the secret ones it found. It also prints
    what an inspecting process might take for its answer."""
    print(json.dumps({"field": "model.name", "message": "printed by the factory"}), flush=True)
    os.write(1, b'{"report": null}\n')
    names = sorted({*IMPORTED_WITH, *os.environ})
    found = {
        k: os.environ[k] for k in ("DPTUNE_OPERATOR_KEY", "DPTUNE_DATABASE_URL") if k in os.environ
    }
    with open(record, "w") as f:
        json.dump({"names": names, "secrets": found}, f)
    return _linear(input_shape, num_classes)


def leaky(input_shape: tuple[int, ...], num_classes: int, kind: str = "runtime") -> nn.Module:
    """Raises an exception whose message holds ``SECRET`` (a ``TypeError`` for ``kind`` "type",
    which once read as options the factory does not take)."""
    raise (TypeError if kind == "type" else RuntimeError)(f"cannot reach {SECRET}")


def slow(input_shape: tuple[int, ...], num_classes: int, seconds: float = 3600.0) -> nn.Module:
    time.sleep(seconds)
    return _linear(input_shape, num_classes)


def hungry(input_shape: tuple[int, ...], num_classes: int, gib: float = 4.0) -> nn.Module:
    """Allocates (without touching) ``gib`` GiB before it builds a linear model."""
    torch.empty(int(gib * 1024**3), dtype=torch.uint8)
    return _linear(input_shape, num_classes)
