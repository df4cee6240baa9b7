"""An imported model's inspection at admission, in a process of its own: ``python -P -m
workers.models.isolated``, started by :mod:`service.own_models`.

The factory's module is imported and its model built and inspected here, never in the control
plane's API process, which holds the operator key and the database credentials: this process
starts with an environment that holds neither (docs/design.md, invariant 10), under a memory
cap, and the control plane kills it when it takes too long.

It reads one request, a JSON object on stdin — ``model`` (a ``ModelConfig``), ``input_shape``,
``num_classes``, ``per_sample`` and ``memory_bytes`` — and writes one answer, a JSON object, to
the stdout it started with: ``{"report": ModelReport}``, or ``{"field": …, "message": …}`` when
the model cannot be built (without the text of the operator's exceptions:
:mod:`workers.models.imported`). What the operator's code prints goes to stderr, which the
control plane logs, so it is never taken for the answer.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
from typing import Any, TextIO


def main() -> None:
    answer = _answer_channel()
    request = json.load(sys.stdin)
    cap = int(request["memory_bytes"])
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))  # heap and private mappings
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    with answer:
        json.dump(inspect_request(request), answer)


def _answer_channel() -> TextIO:
    """A copy of stdout for the answer; stdout itself then goes to stderr."""
    answer = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return answer


def inspect_request(request: dict[str, Any]) -> dict[str, Any]:
    """Build the model of ``request`` and inspect it (torch is imported only now, under the
    memory cap)."""
    from core.config import ModelConfig
    from workers.models import build_model, inspect_model

    cfg = ModelConfig.model_validate(request["model"])
    shape, classes = tuple(request["input_shape"]), int(request["num_classes"])
    try:
        model = build_model(cfg, shape, classes)
    except ValueError as error:
        field, _, message = str(error).partition(": ")
        return {"field": field, "message": message}
    report = inspect_model(model, shape, classes, request["per_sample"])
    return {"report": report.model_dump(mode="json")}


if __name__ == "__main__":
    main()
