"""Episodes through the rollout seam every path uses (rlvr.run.scoring.sample_scored): a scripted model drives a
TRL-style environment with two tools; reset's text reaches the prompt; reward functions get the environments and
the episode as messages, never a tool's output as the answer; get_reward is one more reward; instances go back."""

import pytest

from rlvr.config.loading import load_config
from rlvr.config.schema import EnvConfig
from rlvr.envs.environment import EpisodeError, load_environment
from rlvr.rewards import WeightedReward, completion_text
from rlvr.rollout import SamplingParams
from rlvr.rollout.episodes import EpisodeLimits, Turn, observation_ids, run_episodes
from rlvr.rollout.groups import Groups
from rlvr.run.scoring import EnvironmentSetup, build_environment_setup, sample_scored


class Shop:
    """A TRL-style environment: a stock of items; reset(**row) starts with the row's stock."""

    def reset(self, stock: int, **row) -> str:
        self.stock, self.sold = stock, 0
        return f" (stock: {stock})"

    def sell(self, n: int) -> int:
        """Sell items.

        Args:
            n: how many
        """
        if n > self.stock:
            raise ValueError("not enough stock")
        self.stock -= n
        self.sold += n
        return self.stock

    def count(self) -> int:
        """The items left."""
        return self.stock

    def get_reward(self) -> float:
        return float(self.sold)


CALL = '<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'
SCRIPT = [  # per episode: its model turns
    [CALL.format(name="sell", args='{"n": 2}'), CALL.format(name="count", args="{}"), "Sold 2, 1 left."],
    [CALL.format(name="sell", args='{"n": 9}'), "I could not."],  # the tool raises: an observation, not a crash
    ["<tool_call>not json</tool_call>", "Done."],  # malformed: an observation
    ["No tools: 3."],  # ends at once
]


class ScriptedSampler:
    """A Sampler whose model turns come from SCRIPT (episode i of every batch plays SCRIPT[i]), each closed by the
    end-of-turn token; records the contexts it was given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.version, self.contexts = tokenizer, 3, []
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def sample_episodes(self, prompt_ids, envs, group_size, params, seed, limits):
        turn = [0]

        def turns(contexts, episodes):
            self.contexts.append([list(c) for c in contexts])
            out = []
            for i in episodes:
                ids = self.tokenizer(SCRIPT[i][turn[0]], add_special_tokens=False)["input_ids"] + [self.eos]
                out.append(Turn(ids, [-0.5] * len(ids), False))
            turn[0] += 1
            return out

        return run_episodes(turns, self.tokenizer, prompt_ids, envs, group_size, params, limits, [self.eos],
                            self.version)


ROWS = [{"prompt": [{"role": "user", "content": "Sell some"}], "stock": 3, "target": 2},
        {"prompt": [{"role": "user", "content": "Sell more"}], "stock": 3, "target": 2}]


def _setup(tokenizer, **kw):
    spec = load_environment(Shop, columns=["prompt", "stock", "target"])
    return EnvironmentSetup(spec, EpisodeLimits(max_turns=4, max_episode_tokens=400), tokenizer, False,
                        kw.get("stop_after_call", True))


def test_a_scripted_model_drives_a_trl_style_environment(tokenizer):
    setup = _setup(tokenizer)
    seen = {}

    def sold_target(prompts, completions, environments, target, **kw):
        seen.update(completions=completions, environments=environments)
        return [float(env.sold == t) for env, t in zip(environments, target)]

    sampler = ScriptedSampler(tokenizer)
    got = sample_scored(sampler, ROWS, 2, SamplingParams(max_new_tokens=64), 0,
                        [WeightedReward("sold_target", sold_target)], setup)
    g = got.groups
    assert isinstance(g, Groups) and g.completion_ids.shape[0] == 4 and (g.version == 3).all()
    # rewards: TRL's signature with the environments; get_reward is one more function named after the class
    assert got.scores.per_function["sold_target"].tolist() == [1.0, 0.0, 0.0, 0.0]  # episode i plays SCRIPT[i]
    assert got.scores.per_function["Shop"].tolist() == [2.0, 0.0, 0.0, 0.0]
    assert got.scores.total.tolist() == [3.0, 0.0, 0.0, 0.0]
    assert all(isinstance(e, Shop) for e in seen["environments"])
    # the completion is the conversation; the answer read by graders is the last assistant turn
    first = seen["completions"][0]
    assert [m["role"] for m in first] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert [m["content"] for m in first if m["role"] == "tool"] == ["1", "1"]
    assert completion_text(first) == "Sold 2, 1 left."
    raised = seen["completions"][1][1]["content"]
    assert "error" in raised and "not enough stock" in raised
    assert "malformed" in seen["completions"][2][1]["content"]
    # reset's text is in the prompt, after the user's message, with the tools described in the system message
    prompt = tokenizer.decode(g.prompt_ids[0][g.prompt_mask[0].bool()])
    assert "Sell some (stock: 3)<|im_end|>" in prompt and '"name":"sell"' in prompt and '"name":"count"' in prompt
    # stats: turns per episode, tool calls and errors per tool
    s = got.episode_stats
    assert s.turns == [3, 2, 2, 1]
    m = s.as_metrics()
    assert m["calls/sell"] == 2 and m["calls/count"] == 1 and m["errors/sell/error"] == 1
    assert m["errors/_all/malformed"] == 1 and m["turns_max"] == 3
    # instances went back to the pool: the next batch reuses them
    assert len(setup.spec._idle) == 4


def test_the_token_stream_is_prompt_turns_and_observations(tokenizer):
    setup = _setup(tokenizer)
    sampler = ScriptedSampler(tokenizer)
    got = sample_scored(sampler, ROWS[:1], 1, SamplingParams(max_new_tokens=64), 0, [], setup)
    g = got.groups
    n = int(g.completion_mask[0].sum())
    ids, sampled = g.completion_ids[0, :n].tolist(), g.sampled_mask[0, :n].tolist()
    eos = sampler.eos
    turn = [tokenizer(t, add_special_tokens=False)["input_ids"] + [eos] for t in SCRIPT[0]]
    obs = observation_ids(tokenizer, ["1"])
    assert ids == turn[0] + obs + turn[1] + obs + turn[2]  # token in, token out: nothing re-rendered
    assert sampled == [1] * len(turn[0]) + [0] * len(obs) + [1] * len(turn[1]) + [0] * len(obs) + [1] * len(turn[2])
    assert g.behaviour_logp[0, :n].tolist() == [(-0.5 if s else 0.0) for s in sampled]
    # every turn was sampled from the prompt plus exactly the stream so far
    prompt = g.prompt_ids[0][g.prompt_mask[0].bool()].tolist()
    assert [c[0] for c in sampler.contexts] == [prompt, prompt + turn[0] + obs, prompt + turn[0] + obs + turn[1] + obs]


def test_a_turn_cut_at_the_stop_string_gets_the_end_of_turn_as_observation(tokenizer):
    closed = observation_ids(tokenizer, ["7"])
    open_ = observation_ids(tokenizer, ["7"], turn_closed=False)
    assert tokenizer.decode(open_) == "<|im_end|>" + tokenizer.decode(closed)
    setup = _setup(tokenizer)
    assert setup.params(SamplingParams(stop=("x",))).stop == ("x", "</tool_call>")
    assert _setup(tokenizer, stop_after_call=False).params(SamplingParams()).stop == ()


def test_reset_text_must_be_the_same_for_a_groups_episodes(tokenizer):
    class Random:
        n = 0

        def reset(self, **row):
            Random.n += 1
            return str(Random.n)

        def noop(self) -> int:
            """Nothing."""
            return 0

    setup = EnvironmentSetup(load_environment(Random), EpisodeLimits(), tokenizer, False, True)
    with pytest.raises(EpisodeError, match="different text for the 2 episodes of one row"):
        setup.start(ROWS[:1], 2)
    assert len(setup.spec._idle) == 2  # handed back


def test_env_config_builds_the_tools(tokenizer, tmp_path):
    assert build_environment_setup(EnvConfig(), tokenizer) is None
    setup = build_environment_setup(EnvConfig(tools=("calculator",), max_turns=2), tokenizer)
    assert setup.spec.tool_names == ("calculator",) and setup.limits.max_turns == 2
    with pytest.raises(Exception, match="env.tools 'nope:tool'"):
        build_environment_setup(EnvConfig(tools=("nope:tool",)), tokenizer)
    cfg = load_config(None, ["env.tools=[calculator]", "env.max_turns=3"])
    assert cfg.env.enabled and cfg.env.max_turns == 3
    with pytest.raises(ValueError, match="env.max_turns"):
        load_config(None, ["env.max_turns=0"])


def test_episode_completions_hide_tool_output_from_graders():
    from rlvr.rewards import BUILTINS

    check = BUILTINS["arithmetic_correct"]()
    cheat = [{"role": "assistant", "content": "<tool_call>...</tool_call>"}, {"role": "tool", "content": "391"},
             {"role": "assistant", "content": ""}]
    honest = cheat[:2] + [{"role": "assistant", "content": "The answer is 391."}]
    assert check(prompts=["p", "p"], completions=[cheat, honest], answer=["391", "391"]) == [0.0, 1.0]


def test_tool_success_rewards_a_call_that_returned_a_result():
    from rlvr.rewards import BUILTINS

    reward = BUILTINS["tool_success"]()
    call = {"role": "assistant", "content": "<tool_call>...</tool_call>"}
    worked = [call, {"role": "tool", "content": "391"}, {"role": "assistant", "content": "391"}]
    failed = [call, {"role": "tool", "content": "error: malformed tool call"}, {"role": "assistant", "content": ""}]
    none = [{"role": "assistant", "content": "391"}]
    assert reward(prompts=["p"] * 4, completions=[worked, failed, none, "a string"]) == [1.0, 0.0, 0.0, 0.0]


def test_the_python_tools_sandbox_is_closed_with_the_run(tokenizer):
    from rlvr.verifiers.sandbox import SandboxUnavailable

    try:
        setup = build_environment_setup(EnvConfig(tools=("calculator", "python")), tokenizer)
    except SandboxUnavailable as err:
        pytest.skip(f"no isolation on this machine: {err}")
    sandbox = setup.spec.extra_tools["python"].__self__.sandbox
    assert not sandbox._pool._shutdown
    setup.close()
    assert sandbox._pool._shutdown  # its slots are released now, not at exit
