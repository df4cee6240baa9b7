"""When a random-stopping job that holds its release (``privacy.hold_release``) may show its
end: the one formula for what an analyst sees (``service.visibility``) and for how long the
job's runner keeps its cluster resources (``runner.job.hold``, which asks the control plane
for the time left, so that the runner's clock need not agree with the control plane's)
(docs/design.md, invariant 11).

The hold lasts as long as the cap on K trials would take run one after another like trial 0,
each timed at the longest shape: the end of a job of K ≤ cap such trials then falls inside
it, and neither the status an analyst reads nor the resources the job frees tell K.
"""

from __future__ import annotations

from datetime import datetime, timedelta


def hold_until(started_at: datetime, cap: int, first_trial: timedelta, slowest: float) -> datetime:
    """``started_at + cap × d × r``: ``cap`` the most trials the job may run, ``d`` how long
    trial 0's first attempt ran (``first_trial``) and ``r`` (``slowest``) the longest shape's
    steps over trial 0's, so that a trial 0 that drew a short shape does not end the hold
    early. Trial 0 runs whenever K ≥ 1, and how long it takes does not depend on K."""
    return started_at + cap * slowest * first_trial
