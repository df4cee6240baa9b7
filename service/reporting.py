"""A job's report as a PNG: its trials' DP scores against the searched hyperparameters, and
its dataset's ε spent and committed over the ledger.

The report is one more view of what the caller may already read (docs/design.md, invariants 4
and 11): :func:`collect` builds it only from :mod:`service.visibility`, the module that shapes
the JSON endpoints, so an analyst of a random-stopping job gets the released trial alone and
ledger rows without their times — and then the ledger is drawn against row order, not time.
:func:`draw` and :func:`render` are pure functions of the collected data.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from matplotlib.axes import Axes
from matplotlib.dates import AutoDateLocator, ConciseDateFormatter
from matplotlib.figure import Figure
from sqlalchemy.orm import Session

from core.spec import Selection
from service import ledger, visibility
from service.auth import Principal
from service.db import Dataset, Job, LedgerEntry

LOG_SPAN = 10.0  # a numeric axis whose values span this ratio or more is drawn in log scale
KIND_MARKERS = {"reservation": "^", "charge": "o", "release": "v"}


@dataclass(frozen=True)
class Dimension:
    """A searched hyperparameter: the values listed in the search space, or the two ends of a
    log-uniform range (``continuous``)."""

    path: str
    values: list[Any]
    continuous: bool


@dataclass(frozen=True)
class Point:
    """A trial with a DP score, as the caller sees it (``index`` None when it is withheld)."""

    index: int | None
    params: dict[str, Any]
    score: float
    released: bool


@dataclass(frozen=True)
class Row:
    """A ledger row the caller sees, with the dataset's ε after it (``at`` None when its time
    is withheld; ``own`` only when the caller may know which job the row belongs to)."""

    kind: str
    spent: float
    committed: float
    at: datetime | None
    own: bool


@dataclass(frozen=True)
class Report:
    title: str
    score_label: str
    dimensions: list[Dimension]
    points: list[Point]
    budget: float
    rows: list[Row]
    #: the release noise's standard deviation of a private score (the plan's): error bars
    score_std: float | None = None


def collect(session: Session, job: Job, caller: Principal) -> Report:
    """The report's data: what the job, trials and budget endpoints show ``caller``, and the
    dataset's (spent, committed) ε after each row the caller sees (the rows hidden from an
    analyst carry no amount, so the totals are those of the rows shown)."""
    view = visibility.job_view(job, caller)
    dataset = session.get(Dataset, job.dataset_id)
    if dataset is None:
        raise RuntimeError(f"job {job.id} has no dataset {job.dataset_id}")
    entries = ledger.entries_of(session, dataset.id)
    rows = visibility.ledger_rows(caller, dataset).order_by(LedgerEntry.id)
    totals = dict(
        zip(
            (e.id for e in entries),
            ledger.running_totals(entries, dataset),
            strict=True,
        )
    )
    selection = Selection.model_validate(job.spec["selection"])
    return Report(
        title=(
            f"job {job.id} on {dataset.name!r}: {job.accounting}, "
            f"ε = {job.plan['epsilon']:.3g}, {view.status}"
        ),
        score_label=f"DP score ({selection.metric}, {selection.mode})"
        + (f", ± {job.plan['score_std']:.2g}" if job.plan.get("score_std") else ""),
        dimensions=[
            Dimension(path, next(iter(dim.values())), "log_uniform" in dim)
            for path, dim in job.spec["search_space"].items()
        ],
        points=[
            Point(t.index, t.params, t.score, t.released)
            for t in visibility.trials(job, caller)
            if t.score is not None
        ],
        budget=dataset.epsilon,
        rows=[
            Row(e.kind, *totals[e.id], e.created_at, e.job == job.id)
            for e in visibility.ledger_entries(session, caller, dataset, rows)
        ],
        score_std=job.plan.get("score_std"),
    )


def render(report: Report) -> bytes:
    """The report as PNG bytes (the same data give the same bytes: no time is written)."""
    buffer = io.BytesIO()
    draw(report).savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def draw(report: Report) -> Figure:
    """One panel per searched hyperparameter (one for the trials when nothing is searched),
    above the ledger."""
    columns = max(1, len(report.dimensions))
    figure = Figure(figsize=(max(9.0, 3.6 * columns), 7.5), layout="constrained")
    figure.suptitle(report.title)
    grid = figure.add_gridspec(2, columns)
    for column, dim in enumerate(report.dimensions or [None]):
        ax = figure.add_subplot(grid[0, column])
        if dim is None:
            _trials_by_index(ax, report.points, report.score_std)
        else:
            _trials_by_value(ax, dim, report.points, report.score_std)
        ax.set_ylabel(report.score_label if column == 0 else "")
        _no_data(ax, not report.points, "no trial to show")
    _ledger(figure.add_subplot(grid[1, :]), report.rows, report.budget)
    return figure


def _trials_by_value(
    ax: Axes, dim: Dimension, points: list[Point], std: float | None = None
) -> None:
    """Scores against one hyperparameter. The axis spans the search space, not the trials
    shown, so that it does not move with them."""
    numeric = all(_number(v) for v in dim.values)
    labels = [str(v) for v in dim.values]
    # a stored value that is not one the dimension can take (written past the runner API) is
    # left out, not drawn somewhere misleading
    points = [
        p
        for p in points
        if dim.path in p.params
        and (_number(p.params[dim.path]) if numeric else str(p.params[dim.path]) in labels)
    ]
    if numeric:
        low, high = min(dim.values), max(dim.values)
        if dim.continuous or (low > 0 and high >= LOG_SPAN * low):
            ax.set_xscale("log")
            ax.set_xlim(low / 1.3, high * 1.3)
        else:
            pad = 0.08 * (high - low) or 0.5 * abs(low) or 1.0
            ax.set_xlim(low - pad, high + pad)
        xs = [float(p.params[dim.path]) for p in points]
    else:
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlim(-0.5, len(labels) - 0.5)
        xs = [float(labels.index(str(p.params[dim.path]))) for p in points]
    _scatter(ax, xs, points, std)
    ax.set_xlabel(dim.path)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _trials_by_index(ax: Axes, points: list[Point], std: float | None = None) -> None:
    """A job that searches nothing: scores by trial (the released trial alone, at 0, when
    indices are withheld)."""
    _scatter(ax, [float(p.index or 0) for p in points], points, std)
    ax.set_xlabel("trial")


def _scatter(ax: Axes, xs: list[float], points: list[Point], std: float | None) -> None:
    """The scores, the released one starred; with ``std``, each within ± one standard
    deviation of its release noise (error bars): scores closer than that are a draw."""
    if std and points:
        ys = [_finite(p.score) for p in points]
        ax.errorbar(xs, ys, yerr=std, fmt="none", ecolor="0.6", elinewidth=1, capsize=3)
    others = [(x, p.score) for x, p in zip(xs, points, strict=True) if not p.released]
    best = [(x, p.score) for x, p in zip(xs, points, strict=True) if p.released]
    if others:
        ax.scatter(*_columns(others), color="C0", alpha=0.8, label="trial")
    if best:
        ax.scatter(
            *_columns(best),
            marker="*",
            s=260,
            color="C3",
            edgecolors="black",
            zorder=3,
            label="released",
        )
        ax.legend(loc="best", fontsize="small")
    ax.grid(alpha=0.3)


def _ledger(ax: Axes, rows: list[Row], budget: float) -> None:
    """The dataset's ε after each ledger row: committed (charges and outstanding reservations,
    what admission checks) and spent (charges), against time — or against row order when the
    caller may not see every row's time."""
    ax.set_title("dataset budget", fontsize="medium")
    ax.axhline(budget, color="black", linestyle="--", linewidth=1, label=f"budget ε = {budget:g}")
    ax.set_ylabel("ε")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if _no_data(ax, not rows, "no ledger row"):
        return
    timed = all(r.at is not None for r in rows)
    xs: list[Any] = [r.at for r in rows] if timed else list(range(1, len(rows) + 1))
    committed = [_finite(r.committed) for r in rows]
    spent = [_finite(r.spent) for r in rows]
    ax.step(xs, committed, where="post", color="C1", label="committed (charges + reserved)")
    ax.step(xs, spent, where="post", color="C2", label="spent (charges)")
    # each row is marked on the line it moves: a charge spends, the other kinds commit
    marks = [s if r.kind == "charge" else c for s, c, r in zip(spent, committed, rows, strict=True)]
    _marks(ax, xs, marks, rows)
    if timed:
        locator = AutoDateLocator()
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(ConciseDateFormatter(locator))
        ax.set_xlabel("time (UTC)")
    else:
        ax.set_xlabel("ledger row (times withheld)")
    ax.legend(loc="best", fontsize="small")


def _marks(ax: Axes, xs: list[Any], ys: list[float], rows: list[Row]) -> None:
    """A marker per row by kind, ringed when the row is the job's own."""
    for kind, marker in KIND_MARKERS.items():
        points = [(x, y) for x, y, r in zip(xs, ys, rows, strict=True) if r.kind == kind]
        if points:
            color = "C2" if kind == "charge" else "C1"
            ax.scatter(*_columns(points), marker=marker, color=color, label=kind, zorder=3)
    own = [(x, y) for x, y, r in zip(xs, ys, rows, strict=True) if r.own]
    if own:
        ax.scatter(
            *_columns(own),
            s=150,
            facecolors="none",
            edgecolors="C3",
            zorder=4,
            label="this job's rows",
        )


def _columns(points: list[tuple[Any, float]]) -> tuple[list[Any], list[float]]:
    """(x, y) pairs as the two lists ``scatter`` takes."""
    return [x for x, _ in points], [y for _, y in points]


def _finite(value: float) -> float:
    """A non-finite total (δ of (ε, δ) charges over the dataset's) is left as a gap."""
    return value if math.isfinite(value) else math.nan


def _no_data(ax: Axes, empty: bool, text: str) -> bool:
    if empty:
        ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="gray")
    return empty
