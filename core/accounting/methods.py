"""Privacy as data: what one trial is, and how a tuning job's trials are charged.

In the spirit of dp-accounting's ``DpEvent``s, a job's privacy is described by values that the
planner stores in the job's plan and every part reads back — never by strings dispatched on in
several modules:

- :class:`TrialMechanism`: one trial — T steps of the Poisson-subsampled Gaussian (q, σ),
  composed with the private validation score's Gaussian mechanism when there is one. An
  adaptive clipping rule's noisy statistics are paid for inside σ (paper 001, Theorem 2), so
  the trial costs DP-SGD with σ. Its RDP curve is computed here and nowhere else.
- :data:`TuningMethod`: how K trials are charged — :class:`Rdp` (K fixed, RDP composition, or
  PLD composition where that is smaller),
  :class:`LiuTalwar` (random stopping, an (ε, δ) bound) or :class:`PapernotSteinke` (random K,
  RDP bounds, or a privacy-profile bound where that is smaller). Each answers the same
  questions: what the job costs at δ (``epsilon``), what the ledger charges (``charge``), the
  most trials it may run (``max_trials``), whether K is random (``random_stopping``) and, if
  so, how K is drawn (``draw_trials``). ``epsilon`` and ``charge`` take the trial's RDP curve
  and, optionally, the mechanisms it bounds (a trial may run any one of them), which the
  privacy-profile bound needs.

The method's ``kind`` is the spec's ``privacy.accounting``; :func:`tuning_method` is the one
place that turns a kind and its parameters into a value.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal, Self

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from core.accounting import checks, profile
from core.accounting.charges import Charge, trial_rdp
from core.accounting.library import dp_event
from core.accounting.rdp import epsilon_from_rdp, gaussian_rdp
from core.accounting.tuning import (
    LiuTalwarBound,
    cap_delta,
    checked_eta,
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

    def profile_trial(self) -> profile.Trial:
        """The trial as :mod:`core.accounting.profile` computes its PLD."""
        return (self.sample_rate, self.noise_multiplier, self.steps, self.validation_noise)


#: the mechanisms a trial may run, one of them (:mod:`core.shapes`); none: only its curve is known
Mechanisms = Sequence[TrialMechanism]


class _Method(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    random_stopping: ClassVar[bool]


#: the largest RDP ε at which a job's PLD or privacy-profile bound is computed: four times the
#: spec's largest ε (100), so that calibrating toward any target sees the smaller bound wherever
#: it could be below the target (a PLD at RDP 400 stayed above 188 on the shapes tried, q
#: 0.01–1, T 1–1000); past it the cost jumps back to RDP's, which is sound, only looser
PROFILE_MAX_EPSILON = 400.0


def _with_second(rdp: float, second: Callable[[], float]) -> tuple[float, float]:
    """A job's ε by RDP and by its second bound (PLD, privacy profile); the second is not
    computed where RDP exceeds :data:`PROFILE_MAX_EPSILON`: a trial's PLD grows with its
    privacy loss (at σ = 0.01 it takes minutes and gigabytes), which calibration's first
    brackets would otherwise pay for."""
    return (rdp, math.inf) if rdp > PROFILE_MAX_EPSILON else (rdp, second())


def _statement(epsilon: float, delta: float, own_delta: float | None) -> tuple[float, float] | None:
    """A second bound as an (ε, δ) pair the dataset's filter may count the job as: at the
    smaller of the job's δ and the bound's own; None where the bound is infinite (it does not
    apply)."""
    return None if math.isinf(epsilon) else (epsilon, min(delta, own_delta or delta))


class Rdp(_Method):
    """K fixed trials, all outputs released; RDP curves add (``trials`` counts every reserved
    attempt, retries included).

    With ``pld_delta``, the job is also stated by the pessimistic privacy loss distribution of
    its K-fold composition (dp-accounting's ``PLDAccountant`` arithmetic, Doroshenko et al.,
    "Connect the Dots", PETS 2022): an (ε, δ) statement at that δ (at most the job's), an upper
    bound as every pessimistic PLD is. The job's ε at δ is the smaller of the two (:meth:`bound`),
    and its charge carries the PLD pair (``Charge.pld``), which the dataset may count the job
    as (``service.ledger.statement``). The runs
    are the multiset ``mechanisms`` (each trial's, every entry run ``trials``/len times: one
    shape K times, a scaling job's levels and final run by their counts); their PLDs compose
    adaptively too, each being a fixed mechanism's dominating pair (Zhu, Dong & Wang, "Optimal
    Accounting of Differential Privacy via Characteristic Function", AISTATS 2022, Theorem 10).
    The planner states a grid of shapes by RDP alone. None: RDP alone."""

    kind: Literal["rdp"] = "rdp"
    trials: int = Field(ge=1)
    pld_delta: float | None = Field(None, gt=0, lt=1)
    random_stopping: ClassVar[bool] = False

    @property
    def max_trials(self) -> int:
        return self.trials

    def pld_epsilon(self, delta: float, mechanisms: Mechanisms) -> float:
        """ε at min(δ, ``pld_delta``) of the job's runs' pessimistic PLDs composed, ``mechanisms``
        being its trials' as a multiset, each entry run trials/len(``mechanisms``) times (one
        shape: K times); ``inf`` where it does not apply (no ``pld_delta``, no mechanisms, or
        a count they do not divide)."""
        if self.pld_delta is None or not mechanisms or self.trials % len(mechanisms):
            return math.inf
        per = self.trials // len(mechanisms)
        counts = Counter(m.profile_trial() for m in mechanisms)
        runs = tuple((trial, n * per) for trial, n in counts.items())
        return profile.composed_epsilon(runs, min(self.pld_delta, delta))

    def _bounds(
        self, trial: np.ndarray, delta: float, mechanisms: Mechanisms
    ) -> tuple[float, float]:
        """ε at δ by RDP and by PLD (:func:`_with_second`)."""
        rdp = epsilon_from_rdp(self.trials * trial, delta)[0]
        return _with_second(rdp, lambda: self.pld_epsilon(delta, mechanisms))

    def bound(
        self, trial: np.ndarray, delta: float, mechanisms: Mechanisms = ()
    ) -> Literal["rdp", "pld"]:
        """Which bound states the job: the smaller ε at δ (RDP on a tie)."""
        rdp, by_pld = self._bounds(trial, delta, mechanisms)
        return "pld" if by_pld < rdp else "rdp"

    def charge(
        self, trial: np.ndarray, delta: float, statement_epsilon: float, mechanisms: Mechanisms = ()
    ) -> Charge:
        """The K curves, and the PLD statement as a pair wherever it is finite (whichever
        bound states the job: the dataset's filter picks what it counts the job as)."""
        by_pld = self._bounds(trial, delta, mechanisms)[1]
        pld = _statement(by_pld, delta, self.pld_delta)
        return Charge(rdp=self.trials * trial, pld=pld)

    def epsilon(self, trial: np.ndarray, delta: float, mechanisms: Mechanisms = ()) -> float:
        return min(self._bounds(trial, delta, mechanisms))


#: the largest cap on trials an (ε, δ) bound is computed for: a count that fits a 32-bit
#: integer column (a job runs at most ``core.spec.MAX_TRIALS``)
MAX_CAP = 2**31 - 1


#: Liu–Talwar's default δ₂: this share of the job's δ (the rest pays for the trials' δ₁), the
#: one default of planning and of ``dptune account``
LT_DELTA2_SHARE = 0.5
#: ``ps``'s default cap on K: the smallest whose δ cost is at most this share of the job's δ
CAP_DELTA_SHARE = 0.01


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

    def charge(
        self, trial: np.ndarray, delta: float, statement_epsilon: float, mechanisms: Mechanisms = ()
    ) -> Charge:
        bound = self.bound(trial, delta)
        return Charge(eps_delta=(bound.epsilon, bound.delta))

    def epsilon(self, trial: np.ndarray, delta: float, mechanisms: Mechanisms = ()) -> float:
        return self.bound(trial, delta).epsilon

    def draw_trials(self, rng: np.random.Generator) -> int:
        """K ~ Geometric(γ) on {1, 2, …}, capped at T (part of the bound)."""
        return min(int(rng.geometric(self.gamma)), self.max_trials)


class PapernotSteinke(_Method):
    """Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential Privacy" (ICLR
    2022): K ~ truncated negative binomial D_{η,γ} with the given mean (η = 1 geometric, η = 0
    logarithmic; Definition 1) or Poisson(mean) (``eta`` None, K = 0 possible), only the best
    output released. ``max_trials`` caps K; the cap costs (1 + e^ε)·P[K > cap] of δ
    (:func:`~core.accounting.tuning.cap_delta`). None: uncapped (for comparisons only).

    With ``profile_delta`` (truncated negative binomial K only), the job is also bounded by the
    privacy profile of its trials (:mod:`core.accounting.profile`), an (ε, δ) statement at
    that δ (at most the job's); whichever of the two bounds gives the smaller ε at the job's δ
    states and charges the job (:meth:`bound`). None: the RDP bound alone."""

    kind: Literal["ps"] = "ps"
    mean: float = Field(ge=1)
    eta: Annotated[float, AfterValidator(checked_eta)] | None = Field(None, ge=0)
    max_trials: int | None = Field(None, ge=1)
    profile_delta: float | None = Field(None, gt=0, lt=1)
    random_stopping: ClassVar[bool] = True

    @model_validator(mode="after")
    def _profile_needs_tnb(self) -> Self:
        """The profile bound does not cover Poisson K (:mod:`core.accounting.profile`)."""
        if self.profile_delta is not None and self.eta is None:
            raise ValueError("profile_delta: the profile bound needs an eta (not Poisson K)")
        return self

    def tail(self) -> float:
        """P[K > cap]: the total variation the cap moves the output by."""
        return 0.0 if self.max_trials is None else trials_tail(self.mean, self.eta, self.max_trials)

    def rdp_epsilon(self, trial: np.ndarray, delta: float) -> float:
        """ε at δ by the curve of Theorems 2/6 (:func:`~core.accounting.tuning.ps_epsilon`)."""
        return ps_epsilon(trial, delta, self.mean, self.eta, self.max_trials)

    def profile_epsilon(self, delta: float, mechanisms: Mechanisms) -> float:
        """ε at min(δ, ``profile_delta``) by the privacy-profile bound, cap included; ``inf``
        where it does not apply (no ``profile_delta``, or no mechanisms given)."""
        if self.profile_delta is None or self.eta is None or not mechanisms:
            return math.inf
        trials = tuple(dict.fromkeys(m.profile_trial() for m in mechanisms))
        d = min(self.profile_delta, delta)
        return profile.profile_epsilon(trials, d, self.mean, self.eta, self.tail())

    def _bounds(
        self, trial: np.ndarray, delta: float, mechanisms: Mechanisms
    ) -> tuple[float, float]:
        """ε at δ by the RDP bound and by the profile bound (:func:`_with_second`)."""
        rdp = self.rdp_epsilon(trial, delta)
        return _with_second(rdp, lambda: self.profile_epsilon(delta, mechanisms))

    def bound(
        self, trial: np.ndarray, delta: float, mechanisms: Mechanisms = ()
    ) -> Literal["rdp", "profile"]:
        """Which bound states and charges the job: the smaller ε at δ (RDP on a tie)."""
        rdp, by_profile = self._bounds(trial, delta, mechanisms)
        return "profile" if by_profile < rdp else "rdp"

    def charge(
        self, trial: np.ndarray, delta: float, statement_epsilon: float, mechanisms: Mechanisms = ()
    ) -> Charge:
        """By the RDP bound: the curve of Theorems 2/6, and the cap as (0, (1 + e^ε_D)·t): the
        ledger states the whole dataset at its composed ε_D, at most the dataset's budget ε,
        which the caller passes as ``statement_epsilon`` (see ``service.planning``). By the
        profile bound: its (ε, δ) statement, cap included, composed basically like
        Liu–Talwar's. Wherever the profile bound is finite it is also the charge's ``pld``, so
        the dataset's filter may count the job as it even where RDP states the job."""
        rdp, by_profile = self._bounds(trial, delta, mechanisms)
        pld = _statement(by_profile, delta, self.profile_delta)
        if by_profile < rdp:
            return Charge(eps_delta=pld, pld=pld)
        curve = tuning_rdp(trial, self.mean, self.eta)
        if self.max_trials is None:
            return Charge(rdp=curve, pld=pld)
        cap = (0.0, cap_delta(self.tail(), statement_epsilon))
        return Charge(rdp=curve, eps_delta=cap, pld=pld)

    def epsilon(self, trial: np.ndarray, delta: float, mechanisms: Mechanisms = ()) -> float:
        return min(self._bounds(trial, delta, mechanisms))

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
    ``"rdp", trials=K, pld_delta=…``; ``"lt", gamma=…, delta2=…``; ``"ps", mean=…, eta=…,
    max_trials=…, profile_delta=…``); the PLD and profile bounds apply where there is no
    ``extra_rdp``."""
    checks.probability("delta", delta)
    charged = tuning_method(method, **params)
    curve = trial_rdp(sample_rate, noise_multiplier, steps, extra_rdp)
    if extra_rdp is not None:
        return charged.epsilon(curve, delta)
    trial = TrialMechanism(sample_rate=sample_rate, noise_multiplier=noise_multiplier, steps=steps)
    return charged.epsilon(curve, delta, (trial,))
