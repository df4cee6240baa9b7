"""The DP training engine: sampling, per-sample gradients, clipping, noise, threshold rules,
optimizers. ``per_sample_grad_norms`` is the public per-sample seam (general path)."""

from core.config import PerSamplePath
from workers.dp.clipping import coefficient_fn, resolve_groups
from workers.dp.engine import Clipper, PrivateStep, StepReport
from workers.dp.grads import clipped_grad_sum, per_sample_grad_norms, per_sample_grads


def get_clipper(path: PerSamplePath) -> Clipper:
    """The clipper of ``method.per_sample``: ``general`` (torch.func) or ``fast`` (ghost norms
    and book-keeping, ``workers.dp.ghost``; imported only when asked for)."""
    if path == "general":
        return clipped_grad_sum
    from workers.dp import ghost

    return ghost.clipped_grad_sum


__all__ = [
    "Clipper",
    "PrivateStep",
    "StepReport",
    "clipped_grad_sum",
    "coefficient_fn",
    "get_clipper",
    "per_sample_grad_norms",
    "per_sample_grads",
    "resolve_groups",
]
