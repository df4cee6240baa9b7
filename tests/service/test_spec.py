"""From a job spec to the configuration each trial runs with."""

from __future__ import annotations

import math
import re

import pytest
from pydantic import ValidationError

from core.config import DatasetConfig
from core.shapes import Shape
from core.spec import JobSpec


def _shape(batch_size: int = 64, epochs: float = 1.0, sigma: float = 1.7) -> Shape:
    return Shape(
        batch_size=batch_size,
        epochs=epochs,
        sample_rate=0.1,
        steps=10,
        noise_multiplier=sigma,
        gradient_noise_multiplier=sigma,
        trial_epsilon=1.0,
    )


def test_trial_config_applies_candidate_and_planned_noise(spec):
    job = JobSpec.model_validate(
        spec(1)
        | {
            "search_space": {
                "optimizer.lr": {"grid": [0.05, 0.2]},
                "method.clipping": {"grid": ["abadi", "auto_s"]},
            }
        }
    )
    dataset = DatasetConfig(source="builtin:digits")
    params = {"optimizer.lr": 0.2, "method.clipping": "auto_s"}
    cfg = job.trial_config(dataset, _shape(), 1e-5, params)
    assert (cfg.optimizer.lr, cfg.method.clipping, cfg.method.threshold) == (0.2, "auto_s", 1.0)
    assert (cfg.noise_multiplier, cfg.target_epsilon, cfg.delta) == (1.7, None, 1e-5)
    assert (cfg.batch_size, cfg.validation.noise) == (64, 20.0)
    assert job.optimizer.lr == 0.1  # the spec itself is unchanged
    with pytest.raises(ValueError, match="batch_size"):
        job.trial_config(dataset, _shape(), 1e-5, {"batch_size": 8})


def test_trial_config_runs_the_candidates_shape(spec):
    """A searched batch size and epochs come with the shape's planned σ."""
    job = JobSpec.model_validate(
        spec(1) | {"search_space": {"batch_size": {"grid": [32, 128]}, "epochs": {"grid": [2]}}}
    )
    cfg = job.trial_config(
        DatasetConfig(source="builtin:digits"),
        _shape(128, 2.0, 3.5),
        1e-5,
        {"batch_size": 128, "epochs": 2},
    )
    assert (cfg.batch_size, cfg.epochs, cfg.noise_multiplier) == (128, 2.0, 3.5)
    with pytest.raises(ValueError, match="batch_size: 32 is not the shape's 128"):
        job.trial_config(
            DatasetConfig(source="builtin:digits"), _shape(128), 1e-5, {"batch_size": 32}
        )


@pytest.mark.parametrize(
    ("accounting", "dimension", "message"),
    [
        ("rdp", {"values": [32, 64]}, "give {'grid': [...]} under 'rdp'"),
        ("lt", {"grid": [32, 64]}, "give {'values': [...]} under 'lt'"),
        ("ps", {"log_uniform": [32, 64]}, "give {'values': [...]} under 'ps'"),
        ("rdp", {"grid": [32, 0]}, "bad value 0"),
        ("rdp", {"grid": [32, 32]}, "values repeat"),
    ],
)
def test_shape_dimensions_are_finite_sets_of_valid_values(spec, accounting, dimension, message):
    privacy = {
        "rdp": {"accounting": "rdp"},
        "lt": {"accounting": "lt", "expected_trials": 3},
        "ps": {"accounting": "ps", "mean": 3, "eta": 1},
    }[accounting]
    body = spec(1) | {"search_space": {"batch_size": dimension}}
    body["privacy"] = {"epsilon": 1.0, **privacy}
    with pytest.raises(ValidationError, match=re.escape(message)):
        JobSpec.model_validate(body)


def test_too_many_shapes_are_refused(spec):
    grid = {"batch_size": {"grid": list(range(8, 13))}, "epochs": {"grid": [1, 2, 3, 4]}}
    with pytest.raises(ValidationError, match=r"search_space\.batch_size: 20 combinations"):
        JobSpec.model_validate(spec(1) | {"search_space": grid})


def test_a_log_uniform_draw_that_rounds_past_its_end_runs_at_the_end(spec):
    """exp(U(ln low, ln high)) can round just past an end (exp(ln 100) = 100.00000000000004,
    beyond ``optimizer.lr``'s range): the trial runs the end itself rather than refusing its
    configuration (docs/design.md, invariant 12)."""
    job = JobSpec.model_validate(
        spec(1, trials=2) | {"search_space": {"optimizer.lr": {"log_uniform": [1e-3, 100.0]}}}
    )
    dataset = DatasetConfig(source="builtin:digits")
    for drawn, runs in [(math.exp(math.log(100.0)), 100.0), (0.5, 0.5), (1e-3 * 0.999, 1e-3)]:
        assert (
            job.trial_config(dataset, _shape(), 1e-5, {"optimizer.lr": drawn}).optimizer.lr == runs
        )


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"batch_size": "64"}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"batch_size": 64.0}, "batch_size"),
        ({"epochs": "1"}, "epochs"),
        ({"optimizer": {"lr": "0.1"}}, "optimizer"),
        ({"method": {"threshold": True}}, "method"),
        ({"search_space": {"batch_size": {"grid": ["64"]}}}, "search_space"),
    ],
)
def test_no_string_or_bool_is_read_as_a_number(spec, change, field):
    with pytest.raises(ValidationError) as error:
        JobSpec.model_validate(spec(1) | change)
    first = error.value.errors()[0]
    assert (first["loc"] or (first["msg"].removeprefix("Value error, "),))[0].startswith(field)


def test_json_lists_are_read_as_tuples(spec):
    body = spec(1, trials=2) | {
        "optimizer": {"name": "adam", "betas": [0.5, 0.9]},
        "search_space": {"optimizer.lr": {"log_uniform": [1e-3, 1]}},
    }
    job = JobSpec.model_validate(body)
    assert job.optimizer.betas == (0.5, 0.9)
    assert job.search_space["optimizer.lr"].log_uniform == (1e-3, 1.0)
    assert JobSpec.model_validate(job.model_dump(mode="json")) == job
