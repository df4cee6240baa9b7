"""``python -m runner <job id>``: the entrypoint of a tuning job's Ray job."""

from runner.driver import main

raise SystemExit(main())
