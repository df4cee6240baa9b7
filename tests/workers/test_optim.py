"""The optimizers against torch.optim's, to the bit, and DP-AdamBC (paper 004, Algorithm 2)
against Adam and against a hand computation. A trial never imports ``torch._dynamo``."""

import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.config import OptimizerConfig
from workers.dp.optim import SGD, Adam, AdamBC, build_optimizer


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


@pytest.mark.parametrize("kappa", [0.0, 0.5])
def test_adambc_floor_and_noise_correction_by_hand(kappa):
    """κ = 0: the paper's floor γ′; κ = 0.5: max(γ′, κ·s²) = 0.125 binds the middle coordinate."""
    lr, b1, b2, gp, s = 0.1, 0.9, 0.99, 1e-2, 0.5
    p = torch.nn.Parameter(torch.zeros(3))
    opt = AdamBC([p], lr=lr, betas=(b1, b2), gamma_prime=gp, noise_floor=kappa)
    opt.noise_std = s
    grads = [torch.tensor([2.0, 0.3, 0.0]), torch.tensor([1.0, -0.4, 0.0])]
    m = v = torch.zeros(3)
    theta = torch.zeros(3)
    for t, grad in enumerate(grads, start=1):
        p.grad = grad.clone()
        opt.step()
        m = b1 * m + (1 - b1) * grad
        v = b2 * v + (1 - b2) * grad**2
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        floor = max(gp, kappa * s**2)
        theta = theta - lr * m_hat / torch.sqrt(torch.clamp(v_hat - s**2, min=floor))
    torch.testing.assert_close(p.detach(), theta)
    assert p[2] == 0  # zero gradient: m̂ = 0 and the floor keeps the denominator positive


@settings(max_examples=40, deadline=None)
@given(scale=st.floats(-12, 6), kappa=st.sampled_from([0.01, 0.1, 1.0]))
def test_adambc_on_pure_noise_steps_a_few_lr_at_any_noise_scale_with_a_noise_floor(scale, kappa):
    """The attack on an absolute floor: gradients that are noise of std s = 10^scale alone (no
    signal). With γ′ alone a coordinate whose v̂ − s² falls below γ′ moves by lr·m̂/√γ′, which
    grows with s without bound; with the floor κ·s² every step is at most lr·|m̂|/(√κ·s), a few
    lr whatever s (|m̂| ≤ 4.5·s here: 4.5 standard deviations of the draws)."""
    s, lr = 10.0**scale, 1e-3
    g = torch.Generator().manual_seed(0)
    noise = [s * torch.randn(4096, generator=g).clamp(-4.5, 4.5) for _ in range(30)]
    steps = []
    for floor in (0.0, kappa):
        p = torch.nn.Parameter(torch.zeros(4096))
        opt = AdamBC([p], lr=lr, gamma_prime=1e-8, noise_floor=floor)
        opt.noise_std = s
        largest = 0.0
        for z in noise:
            before = p.detach().clone()
            p.grad = z
            opt.step()
            largest = max(largest, float((p.detach() - before).abs().max()))
        steps.append(largest)
    paper, floored = steps
    assert floored <= lr * 4.5 / kappa**0.5 * 1.01
    if s >= 2e-2:  # where the noise is far above √γ′ = 1e-4 the absolute floor lets steps grow
        assert paper > 10 * floored  # (at s = 1e-2 and κ = 0.01 by 9.9×, at 2e-2 by 16×)


ADAMW = functools.partial(Adam, decoupled=True)
TORCH_TWINS = {  # ours, torch.optim's, the hyperparameters both take
    "sgd": (SGD, torch.optim.SGD, dict(lr=0.1)),
    "sgd momentum, weight decay": (
        SGD,
        torch.optim.SGD,
        dict(lr=0.1, momentum=0.9, weight_decay=0.01),
    ),
    "adam": (Adam, torch.optim.Adam, dict(lr=0.01, betas=(0.8, 0.9), eps=1e-8)),
    "adam weight decay": (
        Adam,
        torch.optim.Adam,
        dict(lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.1),
    ),
    "adamw": (
        ADAMW,
        torch.optim.AdamW,
        dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1),
    ),
}


@pytest.mark.parametrize("name", TORCH_TWINS)
def test_each_optimizer_steps_as_its_torch_optim_class_to_the_bit(name) -> None:
    """Same parameters (one without a gradient on some steps, as torch.optim skips it), same
    gradients: every step leaves the same bits."""
    ours_cls, torch_cls, hyper = TORCH_TWINS[name]
    g = torch.Generator().manual_seed(1)
    start = [torch.randn(4, 3, generator=g), torch.randn(3, generator=g)]
    mine = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    ours, reference = ours_cls(mine, **hyper), torch_cls(theirs, **hyper)
    for step in range(8):
        grads = [torch.randn(t.shape, generator=g) for t in start]
        for params in (mine, theirs):
            for i, (p, grad) in enumerate(zip(params, grads, strict=True)):
                p.grad = None if i == 1 and step % 3 == 2 else grad.clone()
        ours.step()
        reference.step()
        ours.zero_grad()
        assert all(p.grad is None for p in mine)
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a, b), (step, a, b)


def test_a_trial_does_not_import_dynamo() -> None:
    """torch.optim's classes import ``torch._dynamo`` when first built or stepped (1.1–1.9 s of
    every trial process's start). A trial of each optimizer, in a fresh interpreter."""
    code = """
import sys
from core.config import TrialConfig
from workers.trial import run_trial
for name in ("sgd", "adam", "adamw", "adambc"):
    run_trial(TrialConfig.model_validate({
        "dataset": {"source": "builtin:digits"}, "model": {"name": "logreg"}, "epochs": 1,
        "batch_size": 256, "noise_multiplier": 1.0, "device": "cpu",
        "optimizer": {"name": name, "lr": 0.1, "momentum": 0.9 if name == "sgd" else 0.0},
    }))
print("torch._dynamo" in sys.modules)
"""
    root = Path(__file__).resolve().parents[2]
    ran = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert ran.stdout.strip() == "False"


def test_build_optimizer_names():
    model = torch.nn.Linear(2, 2)
    kinds = {"sgd": SGD, "adam": Adam, "adamw": Adam, "adambc": AdamBC}
    for name, cls in kinds.items():
        assert isinstance(build_optimizer(OptimizerConfig(name=name), model), cls)
    assert build_optimizer(OptimizerConfig(name="adamw"), model).decoupled
    assert not build_optimizer(OptimizerConfig(name="adam"), model).decoupled
    sgd = build_optimizer(OptimizerConfig(name="sgd", momentum=0.9), model)
    assert sgd.momentum == pytest.approx(0.9)
