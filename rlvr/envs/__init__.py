"""Environments and tools for multi-turn episodes (docs/concepts/episodes.md).

- ``tools``: a tool's JSON schema from its type hints and docstring (transformers' ``get_json_schema``, as TRL
  uses it), the default tool-call format for templates without tool support (a JSON object inside
  ``<tool_call>…</tool_call>``, the Hermes/Qwen convention), running one call with a deadline so that every
  failure becomes observation text the model reads, and per-tool counts for the metrics.
- ``calculator``: the built-in exact-arithmetic tool (``ast`` + ``fractions``, never ``eval``).
- ``python_tool``: the built-in ``python`` tool (``PythonTool(...).python``): runs the model's code in the code
  graders' sandbox (``rlvr.verifiers.sandbox``: same isolation, same kind of limits) and returns stdout, stderr
  (the traceback of an error) and how the run ended, bounded.
- ``environment``: TRL-style environments run unchanged (``environment_factory``): ``load_environment`` checks a
  factory once before a run (``reset(**row)``, optional ``get_reward()``, every public method a tool with a
  schema; one-line errors naming the class and method); ``EpisodeEnv`` is one instance for one episode
  (``reset`` -> the observation the sampler adds to the prompt with ``prompt_with_observation``, ``step`` per
  model turn -> observations, ``reward``, ``release``; an episode ends on a turn without a tool call).
- ``http_env``: environments served over HTTP in the OpenEnv style (``env.url``): ``HttpEnvironment`` speaks
  openenv-core's reset / step over its WebSocket (or plain HTTP), validated and bounded; ``HttpEnvSpec`` makes one
  per episode.

The turns are driven by ``rlvr.rollout.episodes.run_episodes`` (token in / token out) on every rollout path, and a
run's environment is set up by ``rlvr.run.scoring``. Not here: TRL's dict of factories (several environments in
one run).

This package imports neither torch nor the rest of rlvr, except ``rlvr.verifiers.sandbox`` (``python_tool``);
``tool_schema`` imports transformers when called, ``http_env`` needs httpx (and websockets for its WebSocket).
"""
