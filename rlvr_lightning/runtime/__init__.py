"""The run's process-level safety: atomic checkpoint files and stop signals, ranks and
collectives. May import ``types`` and ``algorithms`` only (nothing of the step)."""
