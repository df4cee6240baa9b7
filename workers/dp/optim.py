"""Optimizers applied to the private gradient, including DP-AdamBC (paper 004)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from core.config import OptimizerConfig


class AdamBC(torch.optim.Optimizer):
    """DP-AdamBC (paper 004, Appendix A, Algorithm 2): Adam whose bias-corrected second moment
    has the DP-noise variance removed, θ ← θ − η·m̂ / sqrt(max(v̂ − s², γ′)), no additive ε.

    s² is the per-coordinate variance of the noise in the averaged private gradient,
    (σ_T·C/B)² with the same normaliser B the engine divides by; the engine sets it each step in
    ``param_group["noise_std"]``. When C changes over steps (adaptive thresholds), s² is the
    same exponential average of the per-step variances that v̂ applies to g², which is the exact
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
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "gamma_prime": gamma_prime,
            "weight_decay": weight_decay,
            "noise_std": 0.0,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p), s2=0.0)
                state["step"] += 1
                t = state["step"]
                state["m"].lerp_(p.grad, 1 - beta1)
                state["v"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                state["s2"] = beta2 * state["s2"] + (1 - beta2) * group["noise_std"] ** 2
                m_hat = state["m"] / (1 - beta1**t)
                v_hat = state["v"] / (1 - beta2**t)
                noise_var = state["s2"] / (1 - beta2**t)
                denom = (v_hat - noise_var).clamp(min=group["gamma_prime"]).sqrt()
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(m_hat, denom, value=-group["lr"])


def build_optimizer(cfg: OptimizerConfig, model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    if cfg.name == "adam":
        return torch.optim.Adam(
            params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    if cfg.name == "adamw":
        return torch.optim.AdamW(
            params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    return AdamBC(
        params,
        lr=cfg.lr,
        betas=cfg.betas,
        gamma_prime=cfg.gamma_prime,
        weight_decay=cfg.weight_decay,
    )
