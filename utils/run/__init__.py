"""The training run: its progress, step plan, checkpoints and resume, run folder, schedules, EMA, signals and hangs."""
