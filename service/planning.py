"""Privacy plan of a tuning job: the noise each trial runs with and what the job costs.

A trial's batch size and epochs are its *shape* (:mod:`core.shapes`); a job that does not
search them has one, and σ is calibrated so that the job's ε at its δ lands at or just below the
analyst's target — counting every reserved retry, so the target holds even if all of them are
used. A job that searches them gives every shape its own σ, each shape's trial costing the same
ε, chosen so that the job as a whole lands at or just below the target (:func:`_shape_noise`).

Defaults the analyst leaves out are chosen here, once, and each choice is explained in the
plan (``Plan.defaults``). They are chosen so that jobs with defaults fit on a dataset in any
order, whatever their accounting method: δs charged by basic composition (Liu–Talwar bounds,
caps on K) come out of the dataset's δ (docs/design.md, invariant 7), so no default takes all of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from pydantic import ValidationError
from sqlalchemy.orm import Session

from core import accounting
from core.accounting import CAP_DELTA_SHARE, STATEMENT_DELTA_SHARE
from core.config import DELTA
from core.noise import gradient_noise
from core.plan import Plan, ProxySearch, TrialCount, score_std
from core.sampling import num_steps
from core.shapes import Shape, combine, trial_curve
from core.spec import MAX_TRIALS, JobSpec, Privacy
from service import ledger, recipes, scaling
from service.db import Dataset

MAX_STEPS = 1_000_000  # DP-SGD steps of one trial
#: a job with several shapes costs ε ∈ [target·(1 − SHAPES_TOLERANCE), target]
SHAPES_TOLERANCE = 0.01
#: rounds of the search for the shapes' common per-trial ε
SHAPES_ROUNDS = 8


class PlanError(ValueError):
    """A job that cannot run on this dataset; ``field`` names the spec field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class PlannedJob:
    plan: Plan
    reservation: accounting.Charge  # the job's full cost, reserved at admission
    spec: JobSpec  # the spec with the planner's defaults filled in: what the job runs


def plan_job(spec: JobSpec, dataset: Dataset, session: Session) -> PlannedJob:
    """Plan ``spec`` on ``dataset``. ``session`` reads the dataset's ledger: an lt job's default
    δ is a share of the δ that (ε, δ) charges do not hold yet."""
    if dataset.awaiting_data:
        raise PlanError(
            "dataset", f"dataset {dataset.id} awaits its data (uploaded by the operator)"
        )
    if dataset.public:
        raise PlanError(
            "dataset", f"dataset {dataset.id} is public: search on it as a job's 'proxy'"
        )
    proxy = _proxy(spec, dataset, session)
    spec, defaults = recipes.fill(spec, dataset.n)
    public = all(d.public_validation for d in (dataset, *proxy))
    spec, validation_default = recipes.fill_validation(spec, dataset.n, public)
    defaults |= validation_default
    privacy = spec.privacy
    delta, delta_default = _job_delta(privacy, dataset, session)
    if delta > dataset.delta:
        raise PlanError("privacy.delta", f"{delta} exceeds the dataset's δ {dataset.delta}")
    if not DELTA[0] <= delta <= DELTA[1]:
        raise PlanError("privacy.delta", f"{delta:g} is outside [{DELTA[0]:g}, {DELTA[1]:g}]")
    validation = spec.validation
    if validation.split == "public" and not public:
        raise PlanError(
            "validation.split", "the dataset has no public validation split; use 'private'"
        )
    method, method_defaults = _tuning_method(spec, dataset, delta, session)
    noise = validation.noise if validation.split == "private" else None
    try:
        sized = _sized_shapes(spec, dataset.n, delta, method, noise)
    except PlanError:
        raise
    except ValueError as error:
        hint = f"; the private validation score (noise {noise}) costs part of it" if noise else ""
        raise PlanError("privacy.epsilon", f"{error}{hint}") from None
    spec, adaptive_default = recipes.fill_adaptive(spec, [(s[0], s[-1]) for s in sized])
    defaults |= adaptive_default
    _check_defaults(spec, defaults)
    shapes = [_shape(spec, size, delta, noise) for size in sized]
    trial = trial_curve(shapes, noise, _any_one(spec, method))
    mechanisms = [s.mechanism(noise) for s in shapes]
    one = shapes[0] if len(shapes) == 1 else None
    plan = Plan(
        accounting=privacy.accounting,
        sample_rate=one and one.sample_rate,
        steps=one and one.steps,
        noise_multiplier=one and one.noise_multiplier,
        gradient_noise_multiplier=one and one.gradient_noise_multiplier,
        shapes=shapes,
        validation_noise=noise,
        score_std=score_std(noise, validation.fraction, dataset.n) if noise else None,
        trials=_trial_count(spec, method),
        attempts_reserved=method.trials if isinstance(method, accounting.Rdp) else None,
        trial_epsilon=max(s.trial_epsilon for s in shapes),
        epsilon=method.epsilon(trial, delta, mechanisms),
        delta=delta,
        method=method,
        bound=(
            None
            if isinstance(method, accounting.LiuTalwar)
            else method.bound(trial, delta, mechanisms)
        ),
        defaults=defaults | delta_default | method_defaults,
        proxy=(
            ProxySearch(dataset=proxy[0].id, trials=spec.candidate_count(), size=proxy[0].n)
            if proxy
            else None
        ),
    )
    reservation = method.charge(trial, delta, dataset.epsilon, mechanisms)
    planned = PlannedJob(plan=plan, reservation=reservation, spec=spec)
    return planned if spec.scaling is None else scaling.plan_scaling(planned)


def _check_defaults(spec: JobSpec, defaults: dict[str, str]) -> None:
    """Validate ``spec`` with the planner's defaults filled in again: a default derived from the
    analyst's numbers (SGD's rate 0.5/C) must lie in its field's range too (docs/design.md,
    invariant 12), or every trial would refuse its configuration."""
    try:
        JobSpec.model_validate(spec.model_dump())
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        why = f" (the planner's default {defaults[field]})" if field in defaults else ""
        raise PlanError(field, f"{first['msg']}{why}; give it in the spec") from None


def _proxy(spec: JobSpec, dataset: Dataset, session: Session) -> tuple[Dataset, ...]:
    """The job's public proxy (none, or one): registered public, and shaped like the private
    dataset, so that the candidate found there trains there as it did on the proxy. Its size
    may differ: each shape runs there at its own q and T (``core.plan.proxy_batch_size``)."""
    if spec.proxy is None:
        return ()
    proxy = session.get(Dataset, spec.proxy)
    if proxy is None or not proxy.public:
        raise PlanError("proxy", f"dataset {spec.proxy} is not registered as public")
    if (proxy.input_shape, proxy.num_classes) != (dataset.input_shape, dataset.num_classes):
        raise PlanError(
            "proxy",
            f"dataset {proxy.id} has inputs {proxy.input_shape} and {proxy.num_classes} classes, "
            f"dataset {dataset.id} {dataset.input_shape} and {dataset.num_classes}",
        )
    return (proxy,)


def _any_one(spec: JobSpec, method: accounting.TuningMethod) -> bool:
    """Whether a trial may run any one of the shapes (:func:`core.shapes.trial_curve`)."""
    return method.random_stopping or spec.proxy is not None


#: a shape before its noise is split: (batch size, epochs, q, T, σ)
Sized = tuple[int, float, float, int, float]


def _sized_shapes(
    spec: JobSpec,
    n: int,
    delta: float,
    method: accounting.TuningMethod,
    noise: float | None,
) -> list[Sized]:
    """Each (batch_size, epochs) of the spec with its q, T and planned σ."""
    sizes = []
    for shape in spec.shape_grid():
        batch_size, epochs = shape["batch_size"], shape["epochs"]
        if batch_size > n:
            raise PlanError("batch_size", f"{batch_size} exceeds the dataset size {n}")
        steps = num_steps(n, batch_size, epochs)
        if steps > MAX_STEPS:
            raise PlanError("epochs", f"{steps} steps per trial exceed {MAX_STEPS}")
        sizes.append((batch_size, epochs, batch_size / n, steps))
    target = spec.privacy.epsilon
    if len(sizes) == 1:
        [(_, _, q, steps)] = sizes
        sigmas: tuple[float, ...] = (_calibrate(q, steps, target, delta, method, noise),)
    else:
        geometry = tuple((q, steps) for _, _, q, steps in sizes)
        sigmas = _shape_noise(geometry, target, delta, method, noise, _any_one(spec, method))
    return [(*size, sigma) for size, sigma in zip(sizes, sigmas, strict=True)]


def _shape(spec: JobSpec, sized: Sized, delta: float, noise: float | None) -> Shape:
    batch_size, epochs, q, steps, sigma = sized
    return Shape(
        batch_size=batch_size,
        epochs=epochs,
        sample_rate=q,
        steps=steps,
        noise_multiplier=sigma,
        gradient_noise_multiplier=_gradient_noise(spec, batch_size, sigma),
        trial_epsilon=accounting.epsilon_from_rdp(_trial(q, sigma, steps, noise), delta)[0],
    )


@lru_cache(maxsize=64)
def _shape_noise(
    sizes: tuple[tuple[float, int], ...],
    target: float,
    delta: float,
    method: accounting.TuningMethod,
    noise: float | None,
    any_one: bool,
) -> tuple[float, ...]:
    """σ of each shape (q, T), all calibrated to one per-trial ε at δ — the largest for which
    the job (its trials charged by :func:`core.shapes.trial_curve`, ``any_one`` as there)
    costs at most ``target``.

    The job's ε grows with the per-trial ε e, so e is found by a secant search on
    (ln e, ln ε_job), which is close to a line: it starts from the e that the first shape alone
    would get, and stops once the job lands in [target·(1 − SHAPES_TOLERANCE), target]. Every
    step computes the job's ε from the calibrated curves themselves, so whatever e it settles
    on, the plan never costs more than the target. 0.1–0.6 s a shape; memoized, so that
    the POST of a job planned just before (``POST /v1/plans``) does not pay it again."""

    q0, steps0 = sizes[0]
    sigma0 = _calibrate(q0, steps0, target, delta, method, noise)
    e = accounting.epsilon_from_rdp(_trial(q0, sigma0, steps0, noise), delta)[0]
    # first guesses from ε ∝ q·√T/σ, then each shape's σ from the last round
    guesses = [sigma0 * q * math.sqrt(steps / steps0) / q0 for q, steps in sizes]

    def job_epsilon(e: float) -> tuple[float, tuple[float, ...]]:
        sigmas = tuple(
            _sigma_for(q, steps, e, delta, noise, guess)
            for (q, steps), guess in zip(sizes, guesses, strict=True)
        )
        guesses[:] = sigmas
        curves = [
            _trial(q, sigma, steps, noise) for (q, steps), sigma in zip(sizes, sigmas, strict=True)
        ]
        mechanisms = [
            accounting.TrialMechanism(
                sample_rate=q, noise_multiplier=sigma, steps=steps, validation_noise=noise
            )
            for (q, steps), sigma in zip(sizes, sigmas, strict=True)
        ]
        return method.epsilon(combine(curves, any_one), delta, mechanisms), sigmas

    best: tuple[float, ...] | None = None
    seen: list[tuple[float, float]] = []
    for _ in range(SHAPES_ROUNDS):
        cost, sigmas = job_epsilon(e)
        if cost <= target:
            best = sigmas
            if cost >= target * (1 - SHAPES_TOLERANCE):
                break
        seen.append((math.log(e), math.log(cost)))
        e = math.exp(_next_log_epsilon(seen, math.log(target * (1 - SHAPES_TOLERANCE / 2))))
    if best is None:
        raise ValueError(f"no per-trial ε makes the job's shapes cost at most {target}")
    return best


def _sigma_for(
    q: float, steps: int, epsilon: float, delta: float, noise: float | None, guess: float
) -> float:
    """σ whose one trial (q, T) costs ε ∈ [epsilon·(1 − 10⁻³), epsilon] at δ. Secant steps on
    (ln σ, ln ε), close to a line, from ``guess`` take a few curves where calibrating from
    scratch (its bracket, then its Illinois steps) takes 5–12; that (``_calibrate``) if they do
    not settle."""
    tolerance = accounting.calibration.RELATIVE_TOLERANCE
    goal = math.log(epsilon * (1 - tolerance / 2))

    def log_epsilon(log_sigma: float) -> float:
        curve = _trial(q, math.exp(log_sigma), steps, noise)
        return math.log(accounting.epsilon_from_rdp(curve, delta)[0])

    x, y = math.log(guess), log_epsilon(math.log(guess))
    before: tuple[float, float] | None = None
    for _ in range(8):
        if epsilon * (1 - tolerance) <= math.exp(y) <= epsilon:
            return math.exp(x)
        slope = -1.0
        if before is not None and before[1] != y:
            slope = min((y - before[1]) / (x - before[0]), -0.05)
        before = (x, y)
        x += max(-1.0, min(1.0, (goal - y) / slope))
        y = log_epsilon(x)
    return _calibrate(q, steps, epsilon, delta, accounting.SINGLE, noise)


def _next_log_epsilon(seen: list[tuple[float, float]], goal: float) -> float:
    """Secant step towards ln ε_job = goal through the last two points (slope 1 from one)."""
    (x1, y1) = seen[-1]
    slope = 1.0
    if len(seen) > 1 and seen[-2][1] != y1:
        x0, y0 = seen[-2]
        slope = max((y1 - y0) / (x1 - x0), 0.1)
    return x1 + (goal - y1) / slope


def _trial(q: float, sigma: float, steps: int, noise: float | None) -> np.ndarray:
    """One trial's curve; its costly part, one step's curve, is memoized by
    :func:`core.accounting.rdp_curve`."""
    mechanism = accounting.TrialMechanism(
        sample_rate=q, noise_multiplier=sigma, steps=steps, validation_noise=noise
    )
    return mechanism.rdp()


def _job_delta(
    privacy: Privacy, dataset: Dataset, session: Session
) -> tuple[float, dict[str, str]]:
    """The job's δ and, when it is a default, why.

    ``rdp`` and ``ps`` jobs are RDP curves that compose with the dataset's other charges, so
    their default is the dataset's δ. A Liu–Talwar job (Liu & Talwar, "Private Selection from
    Private Candidates", STOC 2019) is an (ε, δ) statement: the dataset's filter holds its δ
    out of the share of the dataset's δ that such statements may hold
    (:data:`core.accounting.PAIR_DELTA_SHARE`), so the default is a share of what they do not
    hold yet, and later statements still fit.
    """
    if privacy.delta is not None:
        return privacy.delta, {}
    if privacy.accounting != "lt":
        return dataset.delta, {
            "privacy.delta": (
                f"{dataset.delta:g}, the dataset's δ: {privacy.accounting} charges are RDP curves "
                "that compose with the dataset's other charges."
            )
        }
    delta = _default_statement_delta(dataset, session)
    if delta is None:
        raise PlanError(
            "privacy.delta",
            f"(ε, δ) statements already hold all of the dataset's δ they may hold "
            f"({accounting.Filter(dataset.epsilon, dataset.delta).pair_delta:.3g})",
        )
    return delta, {
        "privacy.delta": (
            f"{delta:.3g}, {STATEMENT_DELTA_SHARE:g} of the dataset's δ that (ε, δ) statements "
            f"may hold and do not hold yet ({delta / STATEMENT_DELTA_SHARE:.3g}): Liu–Talwar's δ "
            "is held out of the dataset's by basic composition, and the rest is left for later "
            "jobs."
        )
    }


def _default_statement_delta(dataset: Dataset, session: Session) -> float | None:
    """The default δ of one more (ε, δ) statement on the dataset; None when its pairs already
    hold all they may (:meth:`core.accounting.Filter.statement_delta`)."""
    rule = accounting.Filter(dataset.epsilon, dataset.delta)
    return rule.statement_delta(ledger.budget(session, dataset).delta_held)


def _tuning_method(
    spec: JobSpec, dataset: Dataset, delta: float, session: Session
) -> tuple[accounting.TuningMethod, dict[str, str]]:
    """The spec's ``privacy`` as a tuning method (:mod:`core.accounting.methods`), with its
    defaults filled in, and why each default was chosen. The one place the spec's kinds become
    values."""
    privacy = spec.privacy
    if privacy.accounting == "rdp":
        return _fixed_k(spec, dataset, delta, session)
    defaults: dict[str, str] = {}
    if privacy.accounting == "lt":
        gamma = privacy.gamma if privacy.gamma is not None else 1 / privacy.expected_trials
        delta2 = privacy.delta2
        if delta2 is None:
            delta2 = accounting.LT_DELTA2_SHARE * delta
            defaults["privacy.delta2"] = (
                f"{delta2:.3g}, {accounting.LT_DELTA2_SHARE:g} of the job's δ: δ₂ pays for the "
                "cap on trials ⌈ln(1/δ₂)/γ⌉ and the rest for the trials' own δ (paper 001, Thm. 1)."
            )
        if delta2 >= delta:
            raise PlanError("privacy.delta2", f"must be below the job's δ {delta}")
        try:
            lt = accounting.tuning_method("lt", gamma=gamma, delta2=delta2)
        except ValueError as error:
            field, reason = str(error).split(": ", 1)
            raise PlanError(f"privacy.{field}", reason) from None
        if lt.max_trials > MAX_TRIALS:
            raise PlanError(
                "privacy.gamma", f"the cap on trials {lt.max_trials} exceeds {MAX_TRIALS}"
            )
        return lt, defaults
    eta = None if privacy.eta == "poisson" else privacy.eta
    # the ledger states the cap at the dataset's budget ε, the job at most at its target ε
    epsilon = max(dataset.epsilon, privacy.epsilon)
    cap = privacy.max_trials
    if cap is None:
        cap = _default_cap(privacy.mean, eta, delta, epsilon)
        defaults["privacy.max_trials"] = (
            f"{cap}, the smallest cap on K with (1 + e^ε)·P[K > cap] ≤ {CAP_DELTA_SHARE:g}·δ at "
            f"ε = {epsilon:g}: a cap changes the output with probability P[K > cap] on both "
            "neighbouring datasets, which costs (1 + e^ε)·P[K > cap] of δ."
        )
    tail = accounting.trials_tail(privacy.mean, eta, cap)
    cost = accounting.cap_delta(tail, epsilon)
    if cost >= delta:
        raise PlanError(
            "privacy.max_trials",
            f"P[K > {cap}] = {tail:.3g} costs (1 + e^{epsilon:g})·{tail:.3g} = {cost:.3g} of δ, "
            f"which leaves nothing of the job's δ {delta:g}",
        )
    profile_delta = None if eta is None else _statement_delta(privacy, dataset, session, delta)
    if profile_delta is not None and privacy.delta is None:  # explained with the δ
        defaults["privacy.delta"] = (
            f"{delta:g}, the dataset's δ, for the Papernot–Steinke RDP bound (a curve that "
            f"composes with the dataset's other charges); the privacy-profile bound is stated "
            f"at {profile_delta:.3g}, {STATEMENT_DELTA_SHARE:g} of the dataset's δ that (ε, δ) "
            "statements may hold and do not hold yet. The smaller bound states the job; the "
            "dataset's filter counts it as its curve or as that pair, whichever takes less of "
            "its budget."
        )
    method = accounting.PapernotSteinke(
        mean=privacy.mean, eta=eta, max_trials=cap, profile_delta=profile_delta
    )
    return method, defaults


def _fixed_k(
    spec: JobSpec, dataset: Dataset, delta: float, session: Session
) -> tuple[accounting.Rdp, dict[str, str]]:
    """K fixed trials, every reserved retry counted, and, for a job of one shape (a scaling
    job's runs are of one shape at several σs), the δ of its PLD statement
    (:class:`core.accounting.Rdp`; a grid of shapes: RDP alone)."""
    privacy = spec.privacy
    trials = spec.trial_count() * (1 + privacy.max_retries)
    one_shape = len(spec.shape_grid()) == 1
    pld_delta = _statement_delta(privacy, dataset, session, delta) if one_shape else None
    method = accounting.Rdp(trials=trials, pld_delta=pld_delta)
    if pld_delta is None or privacy.delta is not None:
        return method, {}
    return method, {
        "privacy.delta": (
            f"{delta:g}, the dataset's δ: rdp charges are RDP curves that compose with the "
            f"dataset's other charges. The job is also stated by the PLD of its composition at "
            f"{pld_delta:.3g}, {STATEMENT_DELTA_SHARE:g} of the dataset's δ that (ε, δ) "
            "statements may hold and do not hold yet; the smaller statement states the job, "
            "and the dataset's filter counts it as its curve or as that pair, whichever takes "
            "less of its budget."
        )
    }


def _statement_delta(
    privacy: Privacy, dataset: Dataset, session: Session, delta: float
) -> float | None:
    """δ of a job's (ε, δ) statement besides its RDP curve: a ps job's privacy-profile bound
    (:mod:`core.accounting.profile`), an rdp job's PLD statement (:class:`core.accounting.Rdp`).
    None (RDP alone) when no δ is left for it.

    The job's δ when the analyst gave one (below the dataset's, for ps); else a share of the
    dataset's δ that (ε, δ) statements may hold and do not hold yet, so that the statement, if
    the dataset counts the job by it, leaves δ for later jobs' statements.
    """
    if privacy.delta is not None and (privacy.accounting == "rdp" or delta < dataset.delta):
        return delta
    return _default_statement_delta(dataset, session)


def _trial_count(spec: JobSpec, method: accounting.TuningMethod) -> TrialCount:
    """How many trials the job runs: fixed K, or its distribution and cap."""
    match method:
        case accounting.LiuTalwar():
            return TrialCount(
                distribution="geometric_stopping", mean=1 / method.gamma, max=method.max_trials
            )
        case accounting.PapernotSteinke(max_trials=int(cap)):
            return TrialCount(
                distribution="poisson" if method.eta is None else "truncated_negative_binomial",
                mean=method.mean,
                max=cap,
                eta=method.eta,
            )
    k = spec.trial_count()
    return TrialCount(distribution="fixed", mean=k, max=k)


def _default_cap(mean: float, eta: float | None, delta: float, epsilon: float) -> int:
    """Smallest cap on K whose δ cost (1 + e^ε)·P[K > cap] (``accounting.cap_delta``) is at
    most ``CAP_DELTA_SHARE``·δ; bisection, as the tail decreases in the cap."""

    def too_costly(cap: int) -> bool:
        tail = accounting.trials_tail(mean, eta, cap)
        return accounting.cap_delta(tail, epsilon) > CAP_DELTA_SHARE * delta

    lo, hi = 1, MAX_TRIALS
    if too_costly(hi):
        raise PlanError(
            "privacy.mean",
            f"K would exceed {MAX_TRIALS} trials too often: even that cap costs more than "
            f"{CAP_DELTA_SHARE:g}·δ at ε = {epsilon:g}",
        )
    while lo < hi:
        mid = (lo + hi) // 2
        if too_costly(mid):
            lo = mid + 1
        else:
            hi = mid
    return lo


def _gradient_noise(spec: JobSpec, batch_size: int, sigma: float) -> float:
    """σ_T of the gradient when part of σ pays for a noisy statistic of the norms."""
    try:
        return gradient_noise(spec.method, batch_size, sigma)
    except ValueError as error:
        field, _, message = str(error).partition(": ")
        raise PlanError(field, message) from None


@lru_cache(maxsize=256)
def _calibrate(
    q: float,
    steps: int,
    epsilon: float,
    delta: float,
    method: accounting.TuningMethod,
    validation_noise: float | None,
) -> float:
    """Calibration takes 5–12 RDP curves (0.2–0.7 s), and as many PLDs for a ps job's profile
    bound; identical jobs reuse the answer (methods are frozen values, so they key the cache)."""
    return accounting.calibrate_noise(
        q, steps, epsilon, delta, method, validation_noise=validation_noise
    )
