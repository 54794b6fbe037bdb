"""Config loading: YAML + dotted overrides, presets, and errors that name the key and the choices."""

import pytest

from rlvr.config import PRESETS, ConfigError, RunConfig, load_config, to_dict


def test_defaults_and_example_load():
    assert load_config(None) == RunConfig()
    cfg = load_config("examples/demo.yaml")
    assert cfg.model.name == "smollm2-135m-instruct" and cfg.model.lora


def test_dotted_overrides_are_typed():
    cfg = load_config(None, ["train.steps=7", "train.lr=1e-3", "model.lora=false", "task.operators=[+, '*']",
                             "rewards=[{name: format, weight: 0.5, kwargs: {pattern: 'x'}}]"])
    assert cfg.train.steps == 7 and cfg.train.lr == 1e-3 and cfg.model.lora is False
    assert cfg.task.operators == ("+", "*")
    reward = cfg.rewards[0]
    assert reward.name == "format" and reward.weight == 0.5 and reward.kwargs == {"pattern": "x"}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_fills_knobs_and_explicit_values_win(preset):
    cfg = load_config(None, [f"algo.preset={preset}"])
    for knob, value in PRESETS[preset].items():
        assert getattr(cfg.algo, knob) == value
    cfg = load_config(None, [f"algo.preset={preset}", "algo.beta=0.5"])
    assert cfg.algo.beta == 0.5


def test_dapo_and_dr_grpo_settings():
    dapo = load_config(None, ["algo.preset=dapo"]).algo
    assert (dapo.aggregation, dapo.eps_high, dapo.beta) == ("token_mean", 0.28, 0.0)
    dr = load_config(None, ["algo.preset=dr_grpo"]).algo
    assert (dr.scale, dr.aggregation) == ("none", "token_sum_constant")


def test_resolved_config_round_trips(tmp_path):
    from rlvr.config import save_config

    cfg = load_config(None, ["algo.preset=dapo", "train.steps=3"])
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.stepz=3", "unknown config key 'train.stepz'; allowed keys in train: steps,"),
        ("bogus=1", "unknown config key 'bogus'"),
        ("algo.preset=reinforce", "algo.preset must be one of grpo, dapo, dr_grpo, ppo; got 'reinforce'"),
        ("algo.aggregation=mean", "algo.aggregation must be one of sequence_mean, token_mean, token_sum_constant"),
        ("algo.kl_estimator=k9", "algo.kl_estimator must be one of k1, k2, k3"),
        ("task.name=gsm8k", "task.name must be one of arithmetic, word_problems, jsonl"),
        ("train.steps=many", "train.steps must be int, got 'many'"),
        ("rollout.group_size=0", "rollout.group_size must be >= 1"),
        ("algo.dual_clip=0.5", "algo.dual_clip must be > 1 (or 0 to disable); got 0.5"),
        ("algo.negative_scale=1.5", "algo.negative_scale must be in [0, 1]"),
        ("algo.is_cap=0.5", "algo.is_cap must be >= 1; got 0.5"),
        ("algo.is_mode=clip", "algo.is_mode must be one of truncate, mask; got 'clip'"),
        ("ppo.value_clip=-1", "ppo.value_clip must be >= 0; got -1.0"),
        ("train", "override 'train' must look like key.sub=value"),
    ],
)
def test_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_jsonl_needs_paths():
    with pytest.raises(ConfigError, match="task.train_path and task.eval_path"):
        load_config(None, ["task.name=jsonl"])


def test_to_dict_is_plain():
    d = to_dict(RunConfig())
    assert d["rewards"][0]["name"] == "arithmetic_correct" and isinstance(d["model"]["lora_targets"], list)


def _sections(cls, seen):
    import dataclasses
    import typing

    if cls not in seen:
        seen.append(cls)
        for tp in typing.get_type_hints(cls).values():
            for t in (tp, *typing.get_args(tp)):
                if dataclasses.is_dataclass(t):
                    _sections(t, seen)
    return seen


def test_every_config_field_has_a_docstring():
    """Each field of every section is documented by a string right under it, in the class that defines it
    (inherited knobs: rlvr.core's LossSettings and PPOSettings)."""
    import ast
    import dataclasses
    import inspect
    import textwrap

    missing = []
    for section in _sections(RunConfig, []):
        for f in dataclasses.fields(section):
            owner = next(c for c in section.__mro__ if f.name in inspect.get_annotations(c))
            body = ast.parse(textwrap.dedent(inspect.getsource(owner))).body[0].body
            at = next(i for i, n in enumerate(body) if isinstance(n, ast.AnnAssign) and n.target.id == f.name)
            nxt = body[at + 1] if at + 1 < len(body) else None
            doc = nxt.value.value if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) else None
            if not isinstance(doc, str):
                missing.append(f"{owner.__name__}.{f.name}")
    assert not missing, missing


def test_loss_and_ppo_knobs_are_defined_once():
    """algo inherits the loss knobs (presets fill them like any other); ppo is rlvr.core's PPOSettings."""
    import dataclasses
    import inspect

    from rlvr.config import AlgoConfig
    from rlvr.core import LossSettings, PPOSettings

    own = set(inspect.get_annotations(AlgoConfig))
    assert not own & {f.name for f in dataclasses.fields(LossSettings)}
    cfg = load_config(None, ["algo.preset=dapo", "algo.dual_clip=3", "ppo.value_clip=0"])
    assert cfg.algo.loss_settings() == LossSettings(eps_high=0.28, aggregation="token_mean", dual_clip=3.0)
    assert type(cfg.algo.loss_settings()) is LossSettings
    assert isinstance(cfg.ppo, PPOSettings) and cfg.ppo.value_clip == 0.0
    assert load_config(None).algo == RunConfig().algo and RunConfig().algo.beta == 0.04
