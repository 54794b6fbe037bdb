"""Environments and tools for multi-turn episodes (issue 23).

Here today:
- ``tools``: a tool's JSON schema from its type hints and docstring (transformers' ``get_json_schema``, as TRL
  uses it), the default tool-call format for templates without tool support (a JSON object inside
  ``<tool_call>…</tool_call>``, the Hermes/Qwen convention), running one call with a deadline so that every
  failure becomes observation text the model reads, and per-tool counts for the metrics.
- ``calculator``: the built-in exact-arithmetic tool (``ast`` + ``fractions``, never ``eval``).

Later (not here yet): the episode sampler drives the turns (token-in / token-out: sampled tokens are kept as
sampled, observations are appended as tokens, history is never re-templated); environments follow TRL's shape
(``reset(**row)`` -> optional observation, every public method a tool, optional ``get_reward()``) or speak
reset/step over HTTP in the OpenEnv style; the ``python`` tool runs code in the verifiers' process sandbox.

This package imports neither torch nor the rest of rlvr (``tool_schema`` imports transformers when called).
"""
