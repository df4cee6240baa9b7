"""Fast per-sample clipping: ghost norms and book-keeping in one backward pass (paper 002).

``clipped_grad_sum`` implements the clipper seam of ``workers/dp`` with the same results as the
general ``torch.func`` path; see ``clipper.py`` for the algorithm and ``layers.py`` for the
per-layer math.
"""

from workers.dp.ghost.clipper import NOT_PER_SAMPLE, FallbackWarning, clipped_grad_sum

__all__ = ["NOT_PER_SAMPLE", "FallbackWarning", "clipped_grad_sum"]
