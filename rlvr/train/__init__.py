"""Training: the one loop (loop.py), GRPO's update (step.py, over forward.py), the batch (batch.py), the synchronous
batch source (collect.py, scoring.py, dynamic_sampling.py), the run it drives (run.py), held-out evaluation."""
