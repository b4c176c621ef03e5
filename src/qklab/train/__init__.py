"""The training loop and what only it needs: optimizers and schedules, the checkpointer, signals, trackers."""
