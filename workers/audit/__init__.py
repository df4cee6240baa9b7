"""Empirical privacy audit of the training engine (``dptune audit``): one training run with
canaries, a statistically valid lower bound on ε next to the ε the run is charged."""

from workers.audit.run import AuditResult, CanaryKind, run_audit

__all__ = ["AuditResult", "CanaryKind", "run_audit"]
