"""From a job spec to the configuration each trial runs with."""

from __future__ import annotations

import pytest

from core.config import DatasetConfig
from core.spec import JobSpec


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
    cfg = job.trial_config(dataset, 1.7, 1e-5, {"optimizer.lr": 0.2, "method.clipping": "auto_s"})
    assert (cfg.optimizer.lr, cfg.method.clipping, cfg.method.threshold) == (0.2, "auto_s", 1.0)
    assert (cfg.noise_multiplier, cfg.target_epsilon, cfg.delta) == (1.7, None, 1e-5)
    assert (cfg.batch_size, cfg.validation.noise) == (64, 20.0)
    assert job.optimizer.lr == 0.1  # the spec itself is unchanged
    with pytest.raises(ValueError, match="batch_size"):
        job.trial_config(dataset, 1.7, 1e-5, {"batch_size": 8})
