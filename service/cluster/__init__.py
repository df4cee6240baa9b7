"""Ray: the local head a state dir owns, started by default, and the orchestrator that runs
each admitted tuning job as a Ray job."""

from service.cluster.head import RayConnection, connect
from service.cluster.ray_jobs import RayOrchestrator, ray_orchestrator

__all__ = ["RayConnection", "RayOrchestrator", "connect", "ray_orchestrator"]
