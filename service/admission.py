"""Whether the cluster can ever run a job's trials, checked at admission so that a job that
could never start is refused with nothing reserved, instead of holding its reservation while
it waits for ever.

A trial runs on one node (``tune.with_resources``: ``resources.cpu`` CPUs and
``resources.gpu`` GPUs of that node; the job's driver asks none), so it can start only on a
node that has at least that much in all. What is free right now is not checked: a busy
cluster frees its resources, and the job waits (its operator view says why).

While the cluster does not answer, admission does not wait for it: the job is admitted as
before, queued with its reservation held, and the check is made when it is handed to the
cluster (:meth:`service.cluster.ray_jobs.RayOrchestrator.submit`), which refuses it then: it
fails having run nothing, and its reservation is released.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from core.spec import Resources
from service.orchestration import Inspectable, Node, Orchestrator, OrchestratorUnavailable
from service.planning import PlanError


def misfit(resources: Mapping[str, float], nodes: Sequence[Node]) -> PlanError | None:
    """Why no node in ``nodes`` can run one trial asking ``resources`` (the spec's
    ``resources``), naming the field to change; None when one can, or when the cluster lists
    no node at all (it is starting: nothing is known of it yet)."""
    wanted = Resources.model_validate(resources)
    if not nodes or any(n.cpu >= wanted.cpu and n.gpu >= wanted.gpu for n in nodes):
        return None
    most_cpu, most_gpu = max(n.cpu for n in nodes), max(n.gpu for n in nodes)
    if wanted.cpu > most_cpu:
        return _never(
            "resources.cpu", f"{wanted.cpu:g} CPUs; the most any node has is {most_cpu:g}"
        )
    if wanted.gpu > most_gpu:
        return _never(
            "resources.gpu", f"{wanted.gpu:g} GPUs; the most any node has is {most_gpu:g}"
        )
    return _never("resources", f"{wanted.cpu:g} CPUs and {wanted.gpu:g} GPUs; no node has both")


def _never(field: str, asked: str) -> PlanError:
    return PlanError(field, f"each trial runs on one node and asks {asked}: it could never start")


def check(resources: Resources, orchestrator: Orchestrator) -> None:
    """Raise :class:`PlanError` (a 422 naming the field) when no node of the orchestrator's
    cluster can ever run one of the job's trials. An orchestrator that cannot tell its nodes,
    or does not answer, is not asked: the job is admitted unchecked (see the module's
    docstring)."""
    if not isinstance(orchestrator, Inspectable):
        return
    try:
        nodes = orchestrator.nodes()
    except OrchestratorUnavailable:
        return
    problem = misfit(resources.model_dump(), nodes)
    if problem is not None:
        raise problem
