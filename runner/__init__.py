"""The runner: what runs a tuning job on Ray — the driver (Ray Tune) and its trainable.

It holds no database credentials and no operator key: it reports to the control plane's
internal API (``service.api.runner``) with the job-scoped token it was started with, and trains
with the engine (``workers``). Entrypoint: ``python -m runner <job id>``.
"""
