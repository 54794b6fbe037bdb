"""Asynchronous GRPO: the batch source (source.py) over the orchestrator, and where rollout servers run
(embedded, Ray)."""
