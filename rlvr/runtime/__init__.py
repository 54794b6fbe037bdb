"""Asynchronous GRPO: the orchestrator, the learner, and where rollout servers run (embedded, Ray)."""
