"""Training: the batch (batch.py), one update (step.py, update.py), the synchronous batch source (collect.py),
the one loop (loop.py) and the run it drives (run.py), held-out evaluation."""
