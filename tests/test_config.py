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
        ("algo.dual_clip=0.5", "algo.dual_clip must be 0 (off) or > 1"),
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


def test_every_config_field_has_a_docstring():
    import ast
    import inspect

    import rlvr.config as config_module

    tree = ast.parse(inspect.getsource(config_module))
    missing = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Config")):
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                documented = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                if not (documented and isinstance(nxt.value.value, str)):
                    missing.append(f"{cls.name}.{node.target.id}")
    assert not missing, missing
