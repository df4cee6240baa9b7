"""What a trial releases: the model as its factory built it, with only the trainable parameters
replaced by what the private step wrote (docs/design.md, invariant 14).

The noise covers only what the DP optimizer writes: each trainable parameter moves by a clipped,
noised gradient. Everything else a model holds (buffers, frozen parameters, any other
``state_dict`` entry) is written by the model's own code, which may read the private inputs: a
running statistic, a cached batch mean. So the release is built from an allow-list, not checked:
those tensors go out at the values they had when the factory returned, before the model saw any
data, whatever the model did to them since; a tensor the model registers later is not released.
Refusing a release whose other state changed would leak instead: whether it changed can depend
on the data, and a failed trial is visible to the analyst (invariant 13). For the same reason
the released layout never depends on the data: it is the initial ``state_dict``'s, tensor for
tensor, which is what the control plane checks an upload against.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class InitialState:
    """A model's state right after its factory built it: a copy of every ``state_dict`` tensor,
    and the trainable parameters (those the optimizer is built on) under every name they have
    in it (a tied parameter has several). Captured before the model sees any data."""

    tensors: dict[str, Tensor]
    trainable: dict[str, nn.Parameter]

    @classmethod
    def capture(cls, model: nn.Module) -> InitialState:
        tensors = {n: t.detach().to("cpu", copy=True) for n, t in model.state_dict().items()}
        named = model.named_parameters(remove_duplicate=False)
        return cls(tensors, {n: p for n, p in named if p.requires_grad and n in tensors})

    def restore(self, model: nn.Module) -> None:
        """Put the model's state other than its trainable parameters back to its initial values,
        wherever the tensor registered under a name still has that name's shape and type: run
        before every step and every evaluation, so that what a forward pass wrote into that
        state from some examples never reaches another step's gradients, nor a score."""
        if not self.untrained:  # the built-in models: nothing but trainable parameters
            return
        current = model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, before in self.untrained.items():
                now = current.get(name)
                if now is not None and now.shape == before.shape and now.dtype == before.dtype:
                    now.copy_(before)

    @cached_property
    def untrained(self) -> dict[str, Tensor]:
        """The initial tensors the DP optimizer never writes: buffers, frozen parameters."""
        return {n: t for n, t in self.tensors.items() if n not in self.trainable}


def released_state(initial: InitialState) -> dict[str, Tensor]:
    """The tensors to save: the initial state with each trainable parameter's current value.
    Values are read from the parameter objects captured at the build, which the optimizer
    updates: a parameter the model swapped for another since is not what it wrote, and one
    whose shape or element type changed is released at its initial value."""
    return {name: _value(initial, name).contiguous() for name in initial.tensors}


def _value(initial: InitialState, name: str) -> Tensor:
    before = initial.tensors[name]
    param = initial.trainable.get(name)
    if param is None or param.shape != before.shape or param.dtype != before.dtype:
        return before
    return param.detach().to("cpu", copy=True)
