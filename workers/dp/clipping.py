"""Clipping groups and clipping functions.

Group-wise clipping (paper 002, eq. 4): the trainable parameters are split into M groups; the
per-sample gradient restricted to group m is clipped at R_m = R/√M, so the concatenated clipped
gradient has norm at most ‖[R_1, …, R_M]‖₂ = R and one Gaussian noise of std σR covers all groups.
(Paper 002's Algorithm 1 drops the 1/√M, which would make the sensitivity √M·R; we follow eq. 4.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from core.config import ClippingFunction

GroupSpec = str | Sequence[Sequence[str]] | None
CoefFn = Callable[[Tensor], Tensor]


def trainable_names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def resolve_groups(model: nn.Module, spec: GroupSpec) -> list[list[str]]:
    """Turn a clipping style into groups of full parameter names (each trainable parameter in
    exactly one group). ``spec`` is None/"all_layer", "layer_wise" (one group per module that owns
    parameters: weight and bias together), "param_wise" (one group per tensor) or a list of
    lists of name prefixes (a prefix matches the name itself or anything below it)."""
    names = trainable_names(model)
    if not names:
        raise ValueError("model: has no trainable parameters")
    if spec is None or spec == "all_layer":
        return [names]
    if spec == "param_wise":
        return [[name] for name in names]
    if spec == "layer_wise":
        return _layer_groups(model, set(names))
    if isinstance(spec, str):
        raise ValueError(f"method.style: unknown clipping style {spec!r}")
    return _prefix_groups(names, spec)


def _layer_groups(model: nn.Module, trainable: set[str]) -> list[list[str]]:
    groups = []
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        own = [prefix + n for n, _ in module.named_parameters(recurse=False)
               if prefix + n in trainable]
        if own:
            groups.append(own)
    return groups


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _prefix_groups(names: list[str], spec: Sequence[Sequence[str]]) -> list[list[str]]:
    groups: list[list[str]] = [[] for _ in spec]
    for name in names:
        owners = [m for m, prefixes in enumerate(spec) if any(_matches(name, p) for p in prefixes)]
        if len(owners) != 1:
            where = "no group" if not owners else f"groups {owners}"
            raise ValueError(f"method.groups: parameter {name!r} matches {where}; "
                             "each trainable parameter must be in exactly one group")
        groups[owners[0]].append(name)
    for m, prefixes in enumerate(spec):
        if not groups[m]:
            raise ValueError(f"method.groups[{m}]: prefixes {list(prefixes)} match no parameter")
    return groups


def group_thresholds(threshold: float, num_groups: int) -> float:
    """R_m = R/√M (paper 002, eq. 4), so the total sensitivity stays R."""
    return threshold / math.sqrt(num_groups)


def coefficient_fn(
    function: ClippingFunction, threshold: float, num_groups: int, gamma: float = 0.01
) -> CoefFn:
    """The per-sample, per-group clip factor C(g; R_m) as a function of the norms [B, M].

    ``abadi``: min(1, R_m/‖g‖) (Abadi et al. 2016). ``auto_s``: R_m/(‖g‖ + γ) and ``auto_v``:
    R_m/‖g‖ (paper 003, automatic clipping); each keeps ‖C·g‖ ≤ R_m, so the sensitivity bound is
    the same for all three. A zero gradient gets factor 0 under AUTO-V (any finite value would do).
    """
    r = group_thresholds(threshold, num_groups)
    if function == "abadi":
        return lambda norms: (r / norms).clamp(max=1.0)
    if function == "auto_s":
        return lambda norms: r / (norms + gamma)
    if function == "auto_v":
        return lambda norms: torch.where(norms > 0, r / norms, torch.zeros_like(norms))
    raise ValueError(f"method.clipping: unknown clipping function {function!r}")
