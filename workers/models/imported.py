"""Models by import path: ``model.name = "package.module:factory"``.

The operator installs the package on the workers (and where the control plane runs, which
inspects the model at admission) and allow-lists its module (``DPTUNE_MODEL_IMPORTS``). The
factory is called with keyword arguments only::

    factory(input_shape=(C, H, W), num_classes=K, **model.options) -> torch.nn.Module

and the module it returns maps a float32 batch [B, *input_shape] to logits [B, K]. The factory
must be *defined* in the module it is named by (its ``__module__``): a name the module merely
imports (``from os import system``) is not a factory, so that an allow-listed module does not
lend its imports to jobs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

from core.config import ModelConfig

Shape = tuple[int, ...]


def load_factory(cfg: ModelConfig) -> Callable[..., Any]:
    """Import the factory ``cfg.name`` names; ValueError naming ``model.name`` if it cannot."""
    assert cfg.factory is not None, "a built-in model has no factory to import"
    module_name, attribute = cfg.factory
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # the module's own code failed: the model cannot be built
        raise ValueError(
            f"model.name: cannot import {module_name!r}: {type(error).__name__}: {error}"
        ) from None
    factory = getattr(module, attribute, None)
    if not callable(factory) or getattr(factory, "__module__", None) != module_name:
        raise ValueError(
            f"model.name: {module_name!r} defines no factory {attribute!r} (a callable "
            "defined in that module)"
        )
    return factory


def build_imported(cfg: ModelConfig, input_shape: Shape, num_classes: int) -> nn.Module:
    """Call the factory; its failures become ValueErrors naming the field to fix (a
    ``TypeError`` is taken for options the factory does not accept)."""
    factory = load_factory(cfg)
    try:
        model = factory(input_shape=input_shape, num_classes=num_classes, **cfg.options)
    except Exception as error:
        field = "model.options" if isinstance(error, TypeError) else "model.name"
        raise ValueError(
            f"{field}: {cfg.name}(input_shape={input_shape}, num_classes={num_classes}, "
            f"**{cfg.options}) failed: {type(error).__name__}: {error}"
        ) from None
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model.name: {cfg.name} returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model.train()
