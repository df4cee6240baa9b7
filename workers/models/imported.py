"""Models by import path: ``model.name = "package.module:factory"``.

The operator installs the package on the workers (and where the control plane runs, which
inspects the model at admission, in a child process: :mod:`workers.models.isolated`) and
allow-lists its module (``DPTUNE_MODEL_IMPORTS``). The factory is called with keyword
arguments only::

    factory(input_shape=(C, H, W), num_classes=K, **model.options) -> torch.nn.Module

and the module it returns maps a float32 batch [B, *input_shape] to logits [B, K]. The factory
must be *defined* in the module it is named by (its ``__module__``): a name the module merely
imports (``from os import system``) is not a factory, so that an allow-listed module does not
lend its imports to jobs.

The errors raised here reach the analyst (a 422 at admission, a failed job's error), so they
name the exception's type and never repeat its message: the operator's code may put anything
it can read into one (docs/design.md, invariant 10). The full text is logged for the operator.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from core.config import ModelConfig

Shape = tuple[int, ...]

log = logging.getLogger(__name__)


def load_factory(cfg: ModelConfig) -> Callable[..., Any]:
    """Import the factory ``cfg.name`` names; ValueError naming ``model.name`` if it cannot."""
    assert cfg.factory is not None, "a built-in model has no factory to import"
    module_name, attribute = cfg.factory
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # the module's own code failed: the model cannot be built
        raise _failed(f"cannot import {module_name!r}", error) from None
    factory = getattr(module, attribute, None)
    if not callable(factory) or getattr(factory, "__module__", None) != module_name:
        raise ValueError(
            f"model.name: {module_name!r} defines no factory {attribute!r} (a callable "
            "defined in that module)"
        )
    return factory


def build_imported(cfg: ModelConfig, input_shape: Shape, num_classes: int) -> nn.Module:
    """Call the factory; its failures become ValueErrors naming the field to fix: options its
    signature does not take are ``model.options``, anything the call raises ``model.name``."""
    factory = load_factory(cfg)
    arguments = {"input_shape": input_shape, "num_classes": num_classes, **cfg.options}
    _check_signature(cfg, factory, arguments)
    try:
        model = factory(**arguments)
    except Exception as error:
        call = f"{cfg.name}(input_shape={input_shape}, num_classes={num_classes}, **{cfg.options})"
        raise _failed(call, error) from None
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model.name: {cfg.name} returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model.train()


def _check_signature(
    cfg: ModelConfig, factory: Callable[..., Any], arguments: dict[str, Any]
) -> None:
    """Options the factory cannot take, told from its signature before any of its code runs
    (the message names parameters only); a factory without a signature is simply called."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(**arguments)
    except TypeError as error:
        raise ValueError(f"model.options: {cfg.name}: {error}") from None


def _failed(what: str, error: Exception) -> ValueError:
    log.warning("model.name: %s failed", what, exc_info=error)
    return ValueError(
        f"model.name: {what}: {type(error).__name__} (its message is in the operator's log)"
    )
