"""Privacy as data: what one trial is, and how a tuning job's trials are charged.

In the spirit of dp-accounting's ``DpEvent``s, a job's privacy is described by values that the
planner stores in the job's plan and every part reads back — never by strings dispatched on in
several modules:

- :class:`TrialMechanism`: one trial — T steps of the Poisson-subsampled Gaussian (q, σ),
  composed with the private validation score's Gaussian mechanism when there is one. An
  adaptive clipping rule's noisy statistics are paid for inside σ (paper 001, Theorem 2), so
  the trial costs DP-SGD with σ. Its RDP curve is computed here and nowhere else.
- :data:`TuningMethod`: how K trials are charged — :class:`Rdp` (K fixed, RDP composition),
  :class:`LiuTalwar` (random stopping, an (ε, δ) bound) or :class:`PapernotSteinke` (random K,
  RDP bounds). Each answers the same questions: what the job costs at δ (``epsilon``), what
  the ledger charges (``charge``), the most trials it may run (``max_trials``), whether K is
  random (``random_stopping``) and, if so, how K is drawn (``draw_trials``).

The method's ``kind`` is the spec's ``privacy.accounting``; :func:`tuning_method` is the one
place that turns a kind and its parameters into a value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, Self

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from core.accounting import checks
from core.accounting.charges import Charge, trial_rdp
from core.accounting.library import dp_event
from core.accounting.rdp import epsilon_from_rdp, gaussian_rdp
from core.accounting.tuning import (
    LiuTalwarBound,
    cap_delta,
    liu_talwar,
    ps_epsilon,
    tnb_gamma,
    trials_tail,
    tuning_rdp,
)


class TrialMechanism(BaseModel):
    """One trial's mechanism; ``release_noise`` is the share of σ an adaptive rule spends on
    its noisy statistics (informational: the split keeps the trial's cost at σ's)."""

    model_config = ConfigDict(frozen=True)

    sample_rate: float = Field(gt=0, le=1)
    noise_multiplier: float = Field(gt=0)
    steps: int = Field(ge=1)
    validation_noise: float | None = Field(None, gt=0)
    release_noise: float | None = Field(None, gt=0)

    def dp_event(self) -> dp_event.DpEvent:
        """The trial as dp-accounting's event: T self-composed Poisson-subsampled Gaussians,
        composed with the validation score's Gaussian."""
        step = dp_event.PoissonSampledDpEvent(
            self.sample_rate, dp_event.GaussianDpEvent(self.noise_multiplier)
        )
        events: list[dp_event.DpEvent] = [dp_event.SelfComposedDpEvent(step, self.steps)]
        if self.validation_noise is not None:
            events.append(dp_event.GaussianDpEvent(self.validation_noise))
        return dp_event.ComposedDpEvent(events)

    def rdp(self) -> np.ndarray:
        """The RDP curve of :meth:`dp_event`, with each step's curve capped at the unsampled
        Gaussian's α/2σ² where dp-accounting's series gives ∞ (:func:`rdp_curve`). That cap is
        why Papernot–Steinke jobs apply Theorems 2/6 to this curve rather than composing
        ``RepeatAndSelectDpEvent(self.dp_event(), …)``: the accountant would carry the ∞
        through (Poisson K at q = 0.05, σ = 0.7, say); wherever both are finite they agree
        exactly (``tests/accounting/test_tuning.py``)."""
        extra = None if self.validation_noise is None else gaussian_rdp(self.validation_noise)
        return trial_rdp(self.sample_rate, self.noise_multiplier, self.steps, extra)

    def epsilon(self, delta: float) -> tuple[float, float]:
        """The trial's own ε at δ, and the optimal RDP order."""
        return epsilon_from_rdp(self.rdp(), delta)


class _Method(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    random_stopping: ClassVar[bool]


class Rdp(_Method):
    """K fixed trials, all outputs released; RDP curves add (``trials`` counts every reserved
    attempt, retries included)."""

    kind: Literal["rdp"] = "rdp"
    trials: int = Field(ge=1)
    random_stopping: ClassVar[bool] = False

    @property
    def max_trials(self) -> int:
        return self.trials

    def charge(self, trial: np.ndarray, delta: float, statement_epsilon: float) -> Charge:
        return Charge(rdp=self.trials * trial)

    def epsilon(self, trial: np.ndarray, delta: float) -> float:
        return epsilon_from_rdp(self.trials * trial, delta)[0]


#: the largest cap on trials an (ε, δ) bound is computed for: a count that fits a 32-bit
#: integer column (a job runs at most ``core.spec.MAX_TRIALS``)
MAX_CAP = 2**31 - 1


#: Liu–Talwar's default δ₂: this share of the job's δ (the rest pays for the trials' δ₁), the
#: one default of planning and of ``dptune account``
LT_DELTA2_SHARE = 0.5


class LiuTalwar(_Method):
    """Liu & Talwar, "Private Selection from Private Candidates" (STOC 2019), as paper 001's
    Theorem 1 states it: after each trial stop with probability γ, at most
    T = ⌈ln(1/δ₂)/γ⌉ trials; charged as an (ε, δ) pair by basic composition."""

    kind: Literal["lt"] = "lt"
    gamma: float = Field(gt=0, le=1)
    delta2: float = Field(gt=0, lt=1)
    random_stopping: ClassVar[bool] = True

    @model_validator(mode="after")
    def _finite_cap(self) -> Self:
        """The cap T must be a number: for a subnormal γ or δ₂ it overflows (no job could run
        it, and ⌈∞⌉ is no integer)."""
        cap = math.log(1 / self.delta2) / self.gamma
        if not cap < MAX_CAP:
            raise ValueError(
                f"gamma: the cap on trials ln(1/δ₂)/γ = {cap:g} is not below {MAX_CAP}"
            )
        return self

    @property
    def max_trials(self) -> int:
        return math.ceil(math.log(1 / self.delta2) / self.gamma)

    def bound(self, trial: np.ndarray, delta: float) -> LiuTalwarBound:
        return liu_talwar(trial, delta, self.gamma, self.delta2)

    def charge(self, trial: np.ndarray, delta: float, statement_epsilon: float) -> Charge:
        bound = self.bound(trial, delta)
        return Charge(eps_delta=(bound.epsilon, bound.delta))

    def epsilon(self, trial: np.ndarray, delta: float) -> float:
        return self.bound(trial, delta).epsilon

    def draw_trials(self, rng: np.random.Generator) -> int:
        """K ~ Geometric(γ) on {1, 2, …}, capped at T (part of the bound)."""
        return min(int(rng.geometric(self.gamma)), self.max_trials)


class PapernotSteinke(_Method):
    """Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential Privacy" (ICLR
    2022): K ~ truncated negative binomial D_{η,γ} with the given mean (η = 1 geometric, η = 0
    logarithmic; Definition 1) or Poisson(mean) (``eta`` None, K = 0 possible), only the best
    output released. ``max_trials`` caps K; the cap costs (1 + e^ε)·P[K > cap] of δ
    (:func:`~core.accounting.tuning.cap_delta`). None: uncapped (for comparisons only)."""

    kind: Literal["ps"] = "ps"
    mean: float = Field(ge=1)
    eta: float | None = Field(None, ge=0)
    max_trials: int | None = Field(None, ge=1)
    random_stopping: ClassVar[bool] = True

    def tail(self) -> float:
        """P[K > cap]: the total variation the cap moves the output by."""
        return 0.0 if self.max_trials is None else trials_tail(self.mean, self.eta, self.max_trials)

    def charge(self, trial: np.ndarray, delta: float, statement_epsilon: float) -> Charge:
        """The curve of Theorems 2/6, and the cap as (0, (1 + e^ε_D)·t): the ledger states the
        whole dataset at its composed ε_D, at most the dataset's budget ε, which the caller
        passes as ``statement_epsilon`` (see ``service.planning``)."""
        curve = tuning_rdp(trial, self.mean, self.eta)
        if self.max_trials is None:
            return Charge(rdp=curve)
        return Charge(rdp=curve, eps_delta=(0.0, cap_delta(self.tail(), statement_epsilon)))

    def epsilon(self, trial: np.ndarray, delta: float) -> float:
        return ps_epsilon(trial, delta, self.mean, self.eta, self.max_trials)

    def draw_trials(self, rng: np.random.Generator) -> int:
        """K from Definition 1 (η = 1 geometric, η = 0 logarithmic, else a negative binomial
        conditioned on K ≥ 1) or Poisson, capped at ``max_trials``."""
        if self.eta is None:
            k = int(rng.poisson(self.mean))
        else:
            gamma = tnb_gamma(self.mean, self.eta)
            if self.eta == 0:
                k = int(rng.logseries(1 - gamma))
            elif self.eta == 1:
                k = int(rng.geometric(gamma))
            else:
                k = 0
                while k == 0:
                    k = int(rng.negative_binomial(self.eta, gamma))
        return k if self.max_trials is None else min(k, self.max_trials)


TuningMethod = Annotated[Rdp | LiuTalwar | PapernotSteinke, Field(discriminator="kind")]
#: kind → class: the spec's ``privacy.accounting`` values
KINDS: dict[str, type[_Method]] = {
    m.model_fields["kind"].default: m for m in (Rdp, LiuTalwar, PapernotSteinke)
}
_METHODS: TypeAdapter[TuningMethod] = TypeAdapter(TuningMethod)
#: one run of one trial
SINGLE = Rdp(trials=1)


def tuning_method(method: str | Mapping[str, Any] | TuningMethod, **params: Any) -> TuningMethod:
    """A method from its value, its stored form (``{"kind": …, …}``) or its kind and
    parameters; errors name the parameter."""
    if isinstance(method, Rdp | LiuTalwar | PapernotSteinke):
        return method
    data = {"kind": method, **params} if isinstance(method, str) else dict(method)
    if data.get("kind") not in KINDS:
        raise ValueError(f"method must be one of {sorted(KINDS)}, got {data.get('kind')!r}")
    try:
        return _METHODS.validate_python(data)
    except ValidationError as error:
        first = error.errors()[0]
        name = ".".join(str(part) for part in first["loc"][1:])
        message = first["msg"].removeprefix("Value error, ")  # a check naming its own field
        raise ValueError(f"{name}: {message}" if name else message) from None


#: the kinds whose K is random: their analysts see only the released trial (invariant 11)
RANDOM_STOPPING = frozenset(kind for kind, m in KINDS.items() if m.random_stopping)


def tuning_epsilon(
    sample_rate: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    method: str | Mapping[str, Any] | TuningMethod,
    *,
    extra_rdp: np.ndarray | None = None,
    **params: Any,
) -> float:
    """ε at overall δ of a tuning job whose trials each run ``steps`` DP-SGD steps (q, σ),
    composed with ``extra_rdp``, charged by ``method`` (a value, or a kind and its parameters:
    ``"rdp", trials=K``; ``"lt", gamma=…, delta2=…``; ``"ps", mean=…, eta=…, max_trials=…``)."""
    checks.probability("delta", delta)
    return tuning_method(method, **params).epsilon(
        trial_rdp(sample_rate, noise_multiplier, steps, extra_rdp), delta
    )
