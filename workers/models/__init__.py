"""Models of a trial: built-in ones by name (``builtin``), the operator's by import path
(``imported``), and the inspection that decides whether DP-SGD may train a model (``inspect``).
"""

from __future__ import annotations

from torch import nn

from core.config import ModelConfig
from workers.models.builtin import Shape, build_builtin
from workers.models.imported import build_imported
from workers.models.inspect import inspect_model


def build_model(cfg: ModelConfig, input_shape: Shape, num_classes: int) -> nn.Module:
    """The model of ``cfg`` for inputs of ``input_shape`` and ``num_classes`` labels."""
    if cfg.factory is None:
        return build_builtin(cfg, input_shape, num_classes)
    return build_imported(cfg, input_shape, num_classes)


__all__ = ["build_model", "inspect_model"]
