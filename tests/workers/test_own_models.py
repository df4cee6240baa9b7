"""Models by import path (``workers.models.imported``) and the inspection that decides whether
DP-SGD may train a model (``workers.models.inspect``), on factories defined outside dptune
(``tests/models_pkg/dptune_test_models.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from core.config import ModelConfig, StateTensor
from workers.dp.ghost import NOT_PER_SAMPLE
from workers.models import build_model, inspect_model

DIGITS = (1, 8, 8)
PACKAGE = Path(__file__).resolve().parents[1] / "models_pkg"


@pytest.fixture(autouse=True)
def models_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PACKAGE))


def own(name: str, shape: tuple[int, ...] = DIGITS, per_sample: str = "fast", **options):
    cfg = ModelConfig(name=f"dptune_test_models:{name}", options=options)
    return inspect_model(build_model(cfg, shape, 10), shape, 10, per_sample)


def test_group_norm_cnn_takes_the_fast_path() -> None:
    report = own("group_norm_cnn", width=4)
    assert report.refused == [] and report.reason == ""
    assert [(r.module, r.type) for r in report.fast] == [
        ("0", "Conv2d"),
        ("1", "GroupNorm"),
        ("5", "Linear"),
    ]
    assert report.general == []
    # conv 1·4·3·3 + 4, GroupNorm 4 + 4, Linear 4·4·4·10 + 10
    assert report.parameters == report.trainable == 40 + 8 + 650
    assert (report.input_shape, report.num_classes, report.per_sample) == ([1, 8, 8], 10, "fast")


def test_general_path_takes_every_module() -> None:
    report = own("group_norm_cnn", per_sample="general")
    assert report.refused == [] and report.fast == []
    assert [(r.module, r.reason) for r in report.general] == [
        (m, "method.per_sample is 'general'") for m in ("0", "1", "5")
    ]


def test_a_layer_without_fast_rule_takes_the_general_path() -> None:
    report = own("recurrent")
    assert report.refused == []
    assert [r.module for r in report.fast] == ["head"]
    assert [(r.module, r.type, r.reason) for r in report.general] == [
        ("lstm", "LSTM", "has no fast rule")
    ]


@pytest.mark.parametrize(
    ("factory", "module", "reason"),
    [
        ("batch_norm_cnn", "1", "BatchNorm normalises over the batch"),
        ("instance_norm_cnn", "1", "tracks running statistics of the data"),
        ("lazy_head", "1", "lazy module"),
        ("batch_centred", "", "an example's output changes with the rest of the batch"),
        ("dropout_mlp", "1", "dropout makes an example's gradient random"),
        ("running_mean", "1", "buffer '1.mean' changes in a training step"),
        ("wrong_output", "", "output is [4, 11], expected logits [4, 10]"),
        ("shared_positions", "position", NOT_PER_SAMPLE),
    ],
)
def test_unfit_models_are_refused(factory: str, module: str, reason: str) -> None:
    report = own(factory)
    assert [r.module for r in report.refused] == [module]
    assert reason in report.refused[0].reason
    assert reason in report.reason


@pytest.mark.parametrize(
    ("keep", "refusal"),
    [
        ("frozen", "frozen parameter '1.stat' changes"),
        ("buffer", "buffer '1.stat' changes"),
        ("train_buffer", "buffer '1.stat' changes"),
        ("later", "buffer '1.stat' appears"),
    ],
)
def test_state_the_model_writes_itself_is_refused(keep: str, refusal: str) -> None:
    """Issue 39, finding 6: a frozen parameter holding the inputs' mean passed, as only
    buffers were compared. The release resets such state whatever admission says
    (``workers.release``); refusing it tells the operator early."""
    report = own("recorder", keep=keep)
    assert [r.module for r in report.refused] == ["1"]
    assert f"{refusal} in a training step" in report.reason


def test_state_written_only_on_some_data_or_outside_the_state_passes() -> None:
    """A dummy batch never holds an exact zero, and a plain attribute is no state: admission
    cannot see these writes, which is why the release is built from an allow-list."""
    assert own("recorder", keep="sparse_buffer").refused == []
    assert own("recorder", keep="attribute").refused == []


def test_the_report_holds_the_state_as_built() -> None:
    """What a release of the model holds, name for name (checked again at upload); a buffer
    registered in the first forward pass is not part of it."""
    assert own("recorder", keep="frozen").state == {
        "1.stat": StateTensor(shape=[64], dtype="float32"),
        "2.weight": StateTensor(shape=[10, 64], dtype="float32"),
        "2.bias": StateTensor(shape=[10], dtype="float32"),
    }
    assert set(own("recorder", keep="later").state) == {"2.weight", "2.bias"}


def test_a_shared_layer_whose_input_looks_per_sample_is_caught_by_its_gradients() -> None:
    """4 rows of positions in a dummy batch of 4: the fast path cannot tell the Embedding's
    [H, d] call from a per-sample one and gets its norms wrong; comparing them with each
    example's own gradient refuses the model (the general path is right)."""
    report = own("shared_positions", shape=(1, 4, 8))  # H = 4 = the dummy batch
    assert [r.module for r in report.refused] == ["position"]
    assert "differs from each example's own gradient" in report.refused[0].reason
    assert own("shared_positions", shape=(1, 4, 8), per_sample="general").refused == []


def test_general_path_accepts_a_layer_fed_the_whole_batch() -> None:
    report = own("shared_positions", per_sample="general")
    assert report.refused == []


def test_inspection_leaves_the_model_as_it_was() -> None:
    cfg = ModelConfig(name="dptune_test_models:group_norm_cnn")
    model = build_model(cfg, DIGITS, 10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inspect_model(model, DIGITS, 10, "fast")
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "options", "shape"),
    [
        ("logreg", {}, DIGITS),
        ("mlp", {"hidden": 8}, DIGITS),
        ("cnn", {}, DIGITS),
        ("resnet18", {"width": 4, "norm_groups": 2}, (3, 8, 8)),
        ("lstm", {"hidden": 5}, (3, 6)),
        ("transformer", {"dim": 8, "heads": 2, "layers": 1, "ff": 16}, (3, 5)),
    ],
)
def test_every_builtin_model_passes(name: str, options: dict, shape: tuple[int, ...]) -> None:
    report = inspect_model(
        build_model(ModelConfig(name=name, options=options), shape, 3), shape, 3, "fast"
    )
    assert report.refused == [] and report.general == []


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("no_such_module:build", {}, "model.name: cannot import 'no_such_module'"),
        ("dptune_test_models:getpid", {}, "model.name: 'dptune_test_models' defines no factory"),
        ("dptune_test_models:missing", {}, "model.name: 'dptune_test_models' defines no factory"),
        (
            "dptune_test_models:not_a_module",
            {},
            "model.name: dptune_test_models:not_a_module returned list, not a torch.nn.Module",
        ),
        ("dptune_test_models:group_norm_cnn", {"depth": 3}, "model.options: dptune_test_models"),
    ],
)
def test_factories_that_cannot_build_a_model(name: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        build_model(ModelConfig(name=name, options=options), DIGITS, 10)


@pytest.mark.parametrize(
    ("model", "loc", "message"),
    [
        ({"name": "gpt"}, ("name",), "'gpt' is neither a built-in model"),
        ({"name": "os.system"}, ("name",), "'os.system' is neither"),  # names no factory
        ({"name": "pkg:_private"}, ("name",), "'pkg:_private' is neither"),
        ({"name": "pkg.:build"}, ("name",), "'pkg.:build' is neither"),
        ({"name": "pkg:build", "options": {"input_shape": 3}}, (), "model.options.input_shape: "),
        ({"name": "pkg:build", "options": {"not-a-name": 3}}, (), "model.options.not-a-name: "),
        ({"name": "pkg:build", "options": {"class": 3}}, (), "model.options.class: "),
    ],
)
def test_model_config_names_the_bad_field(model: dict, loc: tuple, message: str) -> None:
    with pytest.raises(ValidationError) as caught:
        ModelConfig.model_validate(model)
    error = caught.value.errors()[0]
    assert tuple(error["loc"]) == loc
    assert error["msg"].removeprefix("Value error, ").startswith(message)


def test_model_config_keeps_builtins_and_accepts_import_paths() -> None:
    assert ModelConfig(name="resnet18").factory is None
    assert ModelConfig(name="pkg.sub.models:build", options={"width": 4}).factory == (
        "pkg.sub.models",
        "build",
    )
    with pytest.raises(ValueError, match=r"model\.options\.input_shape: not an option"):
        ModelConfig(name="logreg", options={"input_shape": 1})  # built-ins: checked at once


class _Raising(torch.nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where, self.linear = where, torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.where == "forward":
            raise ValueError("token=s3cr3t read by the model")
        out = self.linear(x.flatten(1))
        if self.where == "backward":
            return out + _Boom.apply(out)
        return out


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise RuntimeError("token=s3cr3t read by the model")


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_refusal_names_the_models_exception_but_never_quotes_it(where, caplog) -> None:
    """The refusal reaches the analyst: it names the exception's type, never its text, which
    the model's code wrote and may quote what it read (issue 39, finding 9)."""
    report = inspect_model(_Raising(where), DIGITS, 10, "general")
    assert report.refused, report
    assert "s3cr3t" not in report.reason
    assert ("ValueError" if where == "forward" else "RuntimeError") in report.reason
    assert "s3cr3t" in caplog.text  # the operator's log keeps it
