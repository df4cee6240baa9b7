"""Optimizers applied to the private gradient, including DP-AdamBC (paper 004).

SGD, Adam and AdamW are torch's own update rules, called through their functional forms
(``torch.optim.sgd.sgd``, ``torch.optim.adam.adam``: the same kernels as the ``torch.optim``
classes, and the same choice of the multi-tensor ones on CUDA) on state kept here. The classes
themselves are not used because their constructor, ``step`` and ``zero_grad`` import
``torch._dynamo`` on first use (to keep compilation out of them): a slow import in every trial
process before its first step, though no trial compiles anything. The
functional forms import it only when called under compilation. (The general per-sample path,
``torch.func``, still imports it; the default fast path does not.)
``tests/workers/test_optim.py`` checks each against its ``torch.optim`` class, step by step, to
the bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from core.config import OptimizerConfig


class Optimizer(Protocol):
    """What the engine needs of an optimizer (``torch.optim``'s classes have it too)."""

    def step(self) -> None: ...

    def zero_grad(self) -> None: ...


class _Update:
    """Parameters updated from their ``.grad`` (those without one are left alone, as
    ``torch.optim`` does), with ``torch.optim``'s step pre-hooks: the audit reads the private
    gradient g̃_t there."""

    def __init__(self, params: Iterable[Tensor]) -> None:
        self.params = list(params)
        self._pre_hooks: list[Callable[..., Any]] = []

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> None:
        """``hook(optimizer, args, kwargs)`` runs before every step."""
        self._pre_hooks.append(hook)

    @torch.no_grad()
    def step(self) -> None:
        for hook in self._pre_hooks:
            hook(self, (), {})
        live = [(p, p.grad) for p in self.params if p.grad is not None]
        self._apply([p for p, _ in live], [g for _, g in live])

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _apply(self, params: list[Tensor], grads: list[Tensor]) -> None:
        raise NotImplementedError


class SGD(_Update):
    """``torch.optim.SGD`` (heavy-ball momentum without dampening, L2 weight decay)."""

    def __init__(
        self, params: Iterable[Tensor], lr: float, momentum: float = 0.0, weight_decay: float = 0.0
    ) -> None:
        super().__init__(params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffers: dict[Tensor, Tensor | None] = {}

    def _apply(self, params: list[Tensor], grads: list[Tensor]) -> None:
        buffers = [self.buffers.get(p) for p in params]
        sgd(
            params,
            grads,
            buffers,  # the first step fills in each parameter's buffer
            weight_decay=self.weight_decay,
            momentum=self.momentum,
            lr=self.lr,
            dampening=0.0,
            nesterov=False,
            maximize=False,
        )
        if self.momentum:
            self.buffers.update(zip(params, buffers, strict=True))


class Adam(_Update):
    """``torch.optim.Adam``, or with ``decoupled`` weight decay ``torch.optim.AdamW``."""

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float = 0.0,
        decoupled: bool = False,
    ) -> None:
        super().__init__(params)
        self.lr, self.betas, self.eps = lr, betas, eps
        self.weight_decay, self.decoupled = weight_decay, decoupled
        #: per parameter: its step count (a tensor, as torch keeps it), m and v
        self.state: dict[Tensor, tuple[Tensor, Tensor, Tensor]] = {}

    def _apply(self, params: list[Tensor], grads: list[Tensor]) -> None:
        for p in params:
            if p not in self.state:
                zeros = torch.zeros_like(p, memory_format=torch.preserve_format)
                self.state[p] = (torch.tensor(0.0), zeros, zeros.clone())
        steps, exp_avgs, exp_avg_sqs = zip(*(self.state[p] for p in params), strict=True)
        adam(
            params,
            grads,
            list(exp_avgs),
            list(exp_avg_sqs),
            [],
            list(steps),
            decoupled_weight_decay=self.decoupled,
            amsgrad=False,
            beta1=self.betas[0],
            beta2=self.betas[1],
            lr=self.lr,
            weight_decay=self.weight_decay,
            eps=self.eps,
            maximize=False,
        )


class AdamBC(_Update):
    """DP-AdamBC (paper 004, Appendix A, Algorithm 2): Adam whose bias-corrected second moment
    has the DP-noise variance removed, θ ← θ − η·m̂ / sqrt(max(v̂ − s², γ′, κ·s²)), no additive
    ε. κ = 0 (``noise_floor``) is the paper's rule, whose floor γ′ is absolute: where a
    coordinate's second moment is mostly noise, v̂ − s² falls to γ′ and the step to η·m̂/√γ′,
    however large the noise (m̂ itself is noise of about 0.2·s then). κ > 0 keeps every
    denominator at least √κ·s, at any σ, C and B.

    s² is the per-coordinate variance of the noise in the averaged private gradient,
    (σ_T·C/B)² with the same normaliser B the engine divides by; the engine sets it before each
    step in ``noise_std``. When C changes over steps (adaptive thresholds), s² is the same
    exponential average of the per-step variances that v̂ applies to g², which is the exact
    noise part of E[v̂] and reduces to (σ_T·C/B)² when C is constant. Weight decay, if any, is
    decoupled as in AdamW (the paper uses none).
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        gamma_prime: float = 1e-8,
        weight_decay: float = 0.0,
        noise_floor: float = 0.0,
    ) -> None:
        super().__init__(params)
        self.lr, self.betas, self.gamma_prime = lr, betas, gamma_prime
        self.noise_floor = noise_floor
        self.weight_decay = weight_decay
        self.noise_std = 0.0
        self.state: dict[Tensor, dict[str, Any]] = {}

    def _apply(self, params: list[Tensor], grads: list[Tensor]) -> None:
        beta1, beta2 = self.betas
        for p, grad in zip(params, grads, strict=True):
            if p not in self.state:
                zeros = torch.zeros_like(p)
                self.state[p] = {"step": 0, "m": zeros, "v": zeros.clone(), "s2": 0.0}
            state = self.state[p]
            state["step"] += 1
            t = state["step"]
            state["m"].lerp_(grad, 1 - beta1)
            state["v"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            state["s2"] = beta2 * state["s2"] + (1 - beta2) * self.noise_std**2
            m_hat = state["m"] / (1 - beta1**t)
            v_hat = state["v"] / (1 - beta2**t)
            noise_var = state["s2"] / (1 - beta2**t)
            floor = max(self.gamma_prime, self.noise_floor * noise_var)
            denom = (v_hat - noise_var).clamp(min=floor).sqrt()
            if self.weight_decay:
                p.mul_(1 - self.lr * self.weight_decay)
            p.addcdiv_(m_hat, denom, value=-self.lr)


def build_optimizer(cfg: OptimizerConfig, model: nn.Module) -> SGD | Adam | AdamBC:
    params = [p for p in model.parameters() if p.requires_grad]
    common = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    if cfg.name == "sgd":
        return SGD(params, momentum=cfg.momentum, **common)
    if cfg.name in ("adam", "adamw"):
        return Adam(params, betas=cfg.betas, eps=cfg.eps, decoupled=cfg.name == "adamw", **common)
    return AdamBC(
        params,
        betas=cfg.betas,
        gamma_prime=cfg.gamma_prime,
        noise_floor=cfg.noise_floor,
        **common,
    )
