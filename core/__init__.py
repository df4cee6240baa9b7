"""The shared core: the trial contract (``config``), the job spec (``spec``), the sampling
schedule, the noise split, and the privacy arithmetic (``accounting``) — typed values and pure
functions with no torch, Ray or database, imported by the engine (``workers``), the runner and
the control plane (``service``) alike."""
