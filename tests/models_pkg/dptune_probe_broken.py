"""A module whose import fails with a message that holds a credential."""

raise RuntimeError("cannot reach postgresql://dptune:hunter2-3b1f9c@db.internal/dptune")
