"""What a trial releases (``workers.release``, docs/design.md, invariant 14): the model's initial
state with only the trainable parameters replaced by what the private step wrote.

The attack (issue 39, finding 6): an allow-listed factory whose model writes the mean of its
inputs into state the DP optimizer does not update — a frozen ``Parameter``, a buffer, a buffer
registered in the first forward pass, one written only in training mode or only on some data
(``tests/models_pkg/dptune_test_models.py``, ``recorder``). The trial released
``model.state_dict()``, so the raw mean of a private micro-batch went out without noise.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import runner.trainable
from core.config import ModelConfig, ModelReport, TrialConfig
from core.plan import Plan
from core.spec import JobSpec
from runner.driver import model_refusal
from workers.models import build_model, inspect_model
from workers.release import InitialState, released_state
from workers.trial import TrialOutcome, run_trial

PACKAGE = Path(__file__).resolve().parents[1] / "models_pkg"
#: where ``recorder`` keeps its statistic (``Recorder``)
KEEPS = ["frozen", "buffer", "train_buffer", "sparse_buffer", "later", "attribute"]
TRAINED = ("2.weight", "2.bias")
DIGITS = (1, 8, 8)
#: the private micro-batch's mean in the review's reproduction, against a public 0.5
SECRET = 3906.0


@pytest.fixture(autouse=True)
def models_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PACKAGE))


def _recorder(keep: str, features: int = 4) -> nn.Module:
    from dptune_test_models import recorder

    return recorder(input_shape=(features,), num_classes=2, keep=keep)


def _trial(keep: str) -> TrialOutcome:
    return run_trial(
        TrialConfig.model_validate(
            {
                "dataset": {"source": "builtin:digits"},
                "model": {"name": "dptune_test_models:recorder", "options": {"keep": keep}},
                "epochs": 1,
                "batch_size": 256,
                "noise_multiplier": 1.0,
                "optimizer": {"name": "sgd", "lr": 1.0},
                "method": {"per_sample": "fast"},
                "device": "cpu",
            }
        )
    )


@pytest.mark.parametrize("keep", KEEPS)
def test_a_trial_releases_its_initial_state_with_only_the_trained_parameters(keep: str) -> None:
    """A real trial of each hostile variant (its admission refuses some of them; not these
    writes on some data only, nor a plain attribute): the model's own state holds the data's
    mean, as the trial used to release it; the release holds the state as built but for the
    trained parameters."""
    outcome = _trial(keep)
    assert outcome.model[1].writes > 0  # it wrote the mean of private micro-batches …
    old = outcome.model.state_dict()  # … into what the trial used to release
    # (what a training step wrote is put back before the score: the training-mode-only
    # variant's state is clean by the end, the others' wrote again while being scored)
    assert keep in ("attribute", "train_buffer") or old["1.stat"].any()
    initial, released = outcome.initial.tensors, outcome.released
    assert released.keys() == initial.keys()  # the layout as built: a later buffer is not in it
    assert ("1.stat" in released) == (keep not in ("later", "attribute"))
    for name, tensor in released.items():
        if name in TRAINED:
            assert not torch.equal(tensor, initial[name])  # the private steps moved them …
            assert torch.equal(tensor, old[name])  # … to here
        else:
            assert torch.equal(tensor, initial[name]) and not tensor.any()  # zeros, as built


def test_the_trial_saves_the_release_not_the_models_state(monkeypatch, tmp_path) -> None:
    """``runner.trainable.run_candidate`` writes what the runner uploads: it holds the frozen
    parameter as built (0), not the private micro-batch's mean, and the trained weights."""
    model = _recorder("frozen")
    initial = InitialState.capture(model)
    model(torch.full((8, 4), SECRET))
    _step(model)
    assert model[1].stat.eq(SECRET).all()  # what the old trial saved
    saved = _run_candidate(monkeypatch, tmp_path, TrialOutcome(_result(), model, initial))
    assert saved.keys() == {"1.stat", *TRAINED} and not saved["1.stat"].any()
    assert all(torch.equal(saved[n], model.state_dict()[n]) for n in TRAINED)
    assert not torch.equal(saved["2.weight"], initial.tensors["2.weight"])


def test_workers_that_build_other_tensors_than_admitted_refuse_the_model() -> None:
    """The control plane refuses an upload that is not the admitted state (``plan.model.state``),
    which would come after every trial was charged: the driver's inspection, before any trial,
    refuses a model whose package here builds other tensors."""
    model = {"name": "dptune_test_models:recorder", "options": {"keep": "sparse_buffer"}}
    built = build_model(ModelConfig.model_validate(model), DIGITS, 10)
    report = inspect_model(built, DIGITS, 10, "fast").model_dump(mode="json")
    privacy = {"epsilon": 1.0, "accounting": "rdp"}
    spec = JobSpec.model_validate({"dataset": 1, "model": model, "privacy": privacy})

    def plan(model: dict[str, Any]) -> Plan:  # the refusal reads only the plan's model
        return Plan.model_construct(model=ModelReport.model_validate(model))

    assert model_refusal(spec, plan(report)) is None
    report["state"]["1.stat"]["shape"] = [32]
    assert "other tensors than the one admitted" in str(model_refusal(spec, plan(report)))


def _result() -> dict[str, Any]:
    return {"steps": 1, "score": {"value": 0.5}, "thresholds": None, "timings": {}}


def _run_candidate(monkeypatch, tmp_path: Path, outcome: TrialOutcome) -> dict[str, torch.Tensor]:
    """Run the trainable around ``outcome`` (no Ray, no control plane) and read its file."""
    api = SimpleNamespace(
        start_attempt=lambda *_: 1, finish=lambda *_: None, progress=lambda *_: None
    )
    ctx = SimpleNamespace(
        spec=SimpleNamespace(
            resources=SimpleNamespace(cpu=torch.get_num_threads()), search_space={}
        ),
        plan=SimpleNamespace(trial_epsilon=1.0),
        control_plane=lambda: api,
        weights_path=lambda index: tmp_path / f"trial-{index}.safetensors",
        data_dir=tmp_path,
    )
    monkeypatch.setattr(runner.trainable, "trial_config", lambda *_: None)
    monkeypatch.setattr(runner.trainable, "run_trial", lambda *_, **__: outcome)
    monkeypatch.setattr(runner.trainable.tune, "report", lambda *_: None)
    monkeypatch.setattr(
        runner.trainable.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=str)
    )
    runner.trainable.run_candidate({"trial": {"index": 0, "params": {}}}, ctx)
    return load_file(tmp_path / "trial-0.safetensors")


class Tied(nn.Module):
    """A linear model with a frozen scale and a buffer, and its weight tied to ``other``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.other = nn.Linear(3, 3, bias=False)
        self.other.weight = self.lin.weight
        self.scale = nn.Parameter(torch.ones(3), requires_grad=False)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _step(model: nn.Module) -> None:
    """What the optimizer writes: every trainable parameter moves."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1.0)


def _frozen(model: Tied) -> None:
    model.scale.data.fill_(SECRET)


def _buffer(model: Tied) -> None:
    model.count.fill_(int(SECRET))


def _new_buffer(model: Tied) -> None:
    model.register_buffer("mean", torch.full((3,), SECRET))


def _new_parameter(model: Tied) -> None:
    model.extra = nn.Parameter(torch.full((3,), SECRET))


def _swapped_parameter(model: Tied) -> None:
    """A parameter object the optimizer never saw, where the trained one was."""
    model.lin.bias = nn.Parameter(torch.full((3,), SECRET))


def _retyped_parameter(model: Tied) -> None:
    model.lin.bias.data = torch.full((3,), SECRET, dtype=torch.float64)


def _reshaped_buffer(model: Tied) -> None:
    model.count = torch.full((2,), SECRET)


WRITES: list[Callable[[Tied], None]] = [
    _frozen,
    _buffer,
    _new_buffer,
    _new_parameter,
    _retyped_parameter,  # before the swap: it retypes the parameter the optimizer holds
    _swapped_parameter,
    _reshaped_buffer,
]


@pytest.mark.parametrize(
    "writes", [[w] for w in WRITES] + [WRITES], ids=[w.__name__ for w in WRITES] + ["all"]
)
def test_whatever_the_model_writes_only_the_optimizers_updates_are_released(writes) -> None:
    """Every kind of write after the build, alone and all together: the release holds the
    initial tensors, the trained parameters moved by the step (a tied one under both names, as
    two tensors: safetensors refuses shared memory), and no written value; a parameter whose
    element type changed is not what the optimizer wrote, and goes out as built."""
    model = Tied()
    initial = InitialState.capture(model)
    _step(model)
    for write in writes:
        write(model)
    released = released_state(initial)
    assert released.keys() == initial.tensors.keys()
    moved = {"lin.weight", "other.weight"} | (
        set() if _retyped_parameter in writes else {"lin.bias"}
    )
    for name, tensor in released.items():
        assert torch.equal(tensor, initial.tensors[name] + int(name in moved)), name
    assert released["lin.weight"].data_ptr() != released["other.weight"].data_ptr()


@pytest.mark.parametrize("keep", ["frozen", "buffer", "train_buffer", "sparse_buffer"])
def test_restore_puts_back_what_a_forward_pass_wrote(keep: str) -> None:
    """What the model wrote into its own state from some examples is gone before the next
    step and the score (``InitialState.restore``, called by the trial), so it can carry no
    example's statistics into another step's gradients; the trained parameters stay."""
    model = _recorder(keep)
    initial = InitialState.capture(model)
    with torch.no_grad():
        model[2].weight.add_(1.0)
    model(torch.tensor([[0.0] * 4, [14.0] * 4]))  # an exact zero: the sparse variant writes too
    assert model[1].stat.eq(7.0).all()
    initial.restore(model)
    assert torch.equal(model[1].stat, initial.tensors["1.stat"])
    assert torch.equal(model[2].weight, initial.tensors["2.weight"] + 1.0)


@pytest.mark.parametrize("keep", ["later", "attribute"])
def test_restore_leaves_state_it_did_not_capture(keep: str) -> None:
    model = _recorder(keep)
    initial = InitialState.capture(model)
    model(torch.ones(2, 4))
    initial.restore(model)  # nothing registered at the build to put back; no error either
    assert model[1].stat.eq(1.0).all()
