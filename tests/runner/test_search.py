"""Candidates of the job driver, and the random trial counts its tuning methods draw."""

import math

import numpy as np
import pytest
from pydantic import TypeAdapter
from scipy import stats

from core.accounting import Rdp, tuning_method
from core.accounting.tuning import tnb_gamma
from core.spec import Dimension
from runner.search import candidates, random_candidate

#: a search space as a job spec holds it (``JobSpec.search_space``)
SPACE: TypeAdapter[dict[str, Dimension]] = TypeAdapter(dict[str, Dimension])


def test_grid_times_random_draws() -> None:
    space = SPACE.validate_python(
        {
            "optimizer.lr": {"grid": [0.1, 0.5]},
            "method.threshold": {"log_uniform": [0.1, 10.0]},
            "method.clipping": {"values": ["abadi", "auto_s"]},
        }
    )
    cands = candidates(space, 3, seed=1)
    assert len(cands) == 6
    assert [c["optimizer.lr"] for c in cands] == [0.1] * 3 + [0.5] * 3
    assert all(0.1 <= c["method.threshold"] <= 10 for c in cands)
    assert {c["method.clipping"] for c in cands} <= {"abadi", "auto_s"}
    assert cands == candidates(space, 3, seed=1)  # the prior is fixed by the seed


def test_no_search_space_is_one_default_candidate_per_draw() -> None:
    assert candidates({}, 4, seed=0) == [{}] * 4


def test_log_uniform_is_uniform_in_log() -> None:
    space = SPACE.validate_python({"optimizer.lr": {"log_uniform": [1e-3, 1.0]}})
    cands = candidates(space, 4000, seed=2)
    logs = np.log10([c["optimizer.lr"] for c in cands])
    assert stats.kstest(logs, stats.uniform(loc=-3, scale=3).cdf).pvalue > 1e-3


def empirical(kind: str, params: dict, n: int = 20000) -> np.ndarray:
    rng = np.random.default_rng(7)
    method = tuning_method(kind, **params)
    return np.array([method.draw_trials(rng) for _ in range(n)])


def test_liu_talwar_count_is_geometric_and_capped() -> None:
    ks = empirical("lt", {"gamma": 0.2, "delta2": 1e-6})
    cap = math.ceil(math.log(1e6) / 0.2)
    assert ks.min() >= 1 and ks.max() <= cap
    assert ks.mean() == pytest.approx(5.0, rel=0.05)


@pytest.mark.parametrize("eta", [None, 0.0, 0.5, 1.0, 3.0])
def test_papernot_steinke_counts_have_the_stated_mean(eta: float | None) -> None:
    ks = empirical("ps", {"mean": 6.0, "eta": eta, "max_trials": 1000})
    assert ks.mean() == pytest.approx(6.0, rel=0.05)
    if eta is not None:
        assert ks.min() >= 1
        # P[K = 1] of Def. 1: (1−γ)/(γ^(−η) − 1)·η, or (1−γ)/ln(1/γ) when η = 0
        gamma = tnb_gamma(6.0, eta)
        p1 = (
            (1 - gamma) / math.log(1 / gamma)
            if eta == 0
            else ((1 - gamma) * eta / (gamma**-eta - 1))
        )
        assert (ks == 1).mean() == pytest.approx(p1, abs=0.015)


def test_cap_applies() -> None:
    assert empirical("ps", {"mean": 50.0, "eta": 1.0, "max_trials": 3}, 200).max() == 3


def test_fixed_accounting_has_no_random_count() -> None:
    assert not hasattr(Rdp(trials=3), "draw_trials") and not Rdp.random_stopping


def test_random_stopping_candidates_come_from_os_entropy() -> None:
    """Under lt/ps the released hyperparameters must not tell which draw won: candidates used
    to be drawn from the analyst's seed, so replaying it gave the winner's index (K ≥ index)."""
    space = SPACE.validate_python(
        {
            "optimizer.lr": {"log_uniform": [1e-4, 1.0]},
            "method.clipping": {"values": ["abadi", "auto_s", "auto_v"]},
        }
    )
    draws = []
    for _ in range(2):
        np.random.seed(0)  # every global generator in a state the analyst could know
        draws.append([random_candidate(space) for _ in range(5)])
    assert draws[0] != draws[1]
    replay = candidates(space, 5, seed=0)
    assert all(c not in replay for c in draws[0])
    assert all(1e-4 <= c["optimizer.lr"] <= 1.0 for c in draws[0])
