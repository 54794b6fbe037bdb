"""Everything around the weights: the one loop (loop.py), opening, checkpointing and finishing a run
(lifecycle.py, files.py, resume_checks.py), the synchronous batch source (collect.py, scoring.py,
dynamic_sampling.py, curriculum.py), held-out evaluation, several learners' bookkeeping and DiLoCo's rounds."""
