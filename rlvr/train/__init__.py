"""Training: one update (step.py), the synchronous loop (sync.py), held-out evaluation."""
