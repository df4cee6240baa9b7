"""DP-AdamBC (paper 004, Algorithm 2) against Adam and against a hand computation."""

import pytest
import torch

from core.config import OptimizerConfig
from workers.dp.optim import AdamBC, build_optimizer


def run(optimizer_cls, grads, **kw):
    p = torch.nn.Parameter(torch.ones(5))
    opt = optimizer_cls([p], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def test_adambc_without_noise_equals_adam_without_epsilon():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, generator=g) for _ in range(12)]
    ours = run(AdamBC, grads, lr=0.01, betas=(0.8, 0.9), gamma_prime=1e-30)
    adam = run(torch.optim.Adam, grads, lr=0.01, betas=(0.8, 0.9), eps=0.0)
    torch.testing.assert_close(ours, adam)


def test_adambc_floor_and_noise_correction_by_hand():
    lr, b1, b2, gp, s = 0.1, 0.9, 0.99, 1e-2, 0.5
    p = torch.nn.Parameter(torch.zeros(3))
    opt = AdamBC([p], lr=lr, betas=(b1, b2), gamma_prime=gp)
    opt.param_groups[0]["noise_std"] = s
    grads = [torch.tensor([2.0, 0.3, 0.0]), torch.tensor([1.0, -0.4, 0.0])]
    m = v = torch.zeros(3)
    theta = torch.zeros(3)
    for t, grad in enumerate(grads, start=1):
        p.grad = grad.clone()
        opt.step()
        m = b1 * m + (1 - b1) * grad
        v = b2 * v + (1 - b2) * grad**2
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        theta = theta - lr * m_hat / torch.sqrt(torch.clamp(v_hat - s**2, min=gp))
    torch.testing.assert_close(p.detach(), theta)
    assert p[2] == 0  # zero gradient: m̂ = 0 and the floor keeps the denominator positive


def test_build_optimizer_names():
    model = torch.nn.Linear(2, 2)
    kinds = {
        "sgd": torch.optim.SGD,
        "adam": torch.optim.Adam,
        "adamw": torch.optim.AdamW,
        "adambc": AdamBC,
    }
    for name, cls in kinds.items():
        assert isinstance(build_optimizer(OptimizerConfig(name=name), model), cls)
    sgd = build_optimizer(OptimizerConfig(name="sgd", momentum=0.9), model)
    assert sgd.param_groups[0]["momentum"] == pytest.approx(0.9)
