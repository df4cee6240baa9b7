"""Fault injection for the audit: a gradient-noise stream whose draws are scaled.

Only :func:`workers.audit.run.run_audit` builds one (``dptune audit --noise-scale``); nothing a
production trial reads can select it. With a scale below 1 the run adds less noise than its
accountant charges for, i.e. a broken build, which the audit must catch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from workers.dp.randomness import SecureStream


class ScaledNoise(SecureStream):
    """A :class:`SecureStream` whose normal draws are multiplied by ``scale``: a multiplier on
    whatever standard deviation the engine asks :meth:`normal` for (drawing ahead goes through
    :meth:`normal` too), so the fault does not depend on the units the engine draws in."""

    def __init__(self, scale: float) -> None:
        if not scale > 0:
            raise ValueError(f"noise_scale: must be positive, got {scale}")
        super().__init__()
        self.scale = scale

    def normal(
        self,
        shape: int | Sequence[int],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        out: Tensor | None = None,
        scale: float = 1.0,
    ) -> Tensor:
        return super().normal(shape, device=device, dtype=dtype, out=out, scale=scale * self.scale)
