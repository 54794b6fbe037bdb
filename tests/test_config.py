"""Config loading: YAML + dotted overrides, presets, and errors that name the key and the choices."""

import pytest

from rlvr.config.loading import ConfigError, load_config, to_dict
from rlvr.config.schema import PRESETS, AlgoConfig, RolloutConfig, RunConfig, TrainConfig


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


# Every algo key of the resolved config (config.yaml), per preset; written out by hand, not read from PRESETS.
ALGO_DEFAULTS = {
    "objective": "ppo_clip", "eps_low": 0.2, "dual_clip": 0.0, "sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05,
    "kl_estimator": "k3", "kl_ratio_weighted": False, "entropy_coef": 0.0, "top_entropy_quantile": 1.0,
    "count_untrained_rows": False, "ratio_to": "proximal",
    "is_level": "token", "is_mode": "truncate", "is_cap": 2.0, "gap_mask": 0.0, "num_iterations": 1, "adv_eps": 1e-4,
    "mask_truncated": False, "negative_scale": 1.0, "max_resample_rounds": 3,
    "reward_aggregation": "sum_then_normalize", "ref_sync_steps": 0, "ref_mixup_alpha": 0.6,
}
RESOLVED_PRESETS = {
    "grpo": {"name": "grpo", "scale": "group", "aggregation": "sequence_mean", "eps_high": 0.2, "beta": 0.04,
             "dynamic_sampling": False},
    "dapo": {"name": "grpo", "scale": "group", "aggregation": "token_mean", "eps_high": 0.28, "beta": 0.0,
             "dynamic_sampling": True},
    "dr_grpo": {"name": "grpo", "scale": "none", "aggregation": "token_sum_constant", "eps_high": 0.2, "beta": 0.0,
                "dynamic_sampling": False},
    "ppo": {"name": "ppo", "scale": "none", "aggregation": "token_mean", "eps_high": 0.2, "beta": 0.0,
            "dynamic_sampling": False},
    "gspo": {"name": "grpo", "scale": "group", "objective": "gspo", "aggregation": "sequence_mean", "eps_low": 3e-4,
             "eps_high": 4e-4, "beta": 0.0, "dynamic_sampling": False},
    "luspo": {"name": "grpo", "scale": "group", "objective": "gspo", "aggregation": "sequence_sum", "eps_low": 2e-3,
              "eps_high": 2.5e-3, "beta": 0.0, "dynamic_sampling": False},
    "cispo": {"name": "grpo", "scale": "group", "objective": "cispo", "aggregation": "token_mean", "eps_low": 1.0,
              "eps_high": 4.0, "beta": 0.0, "dynamic_sampling": False},
    "sapo": {"name": "grpo", "scale": "group", "objective": "sapo", "aggregation": "sequence_mean", "eps_high": 0.2,
             "beta": 0.0, "dynamic_sampling": False},
}


@pytest.mark.parametrize("preset", sorted(RESOLVED_PRESETS))
def test_each_preset_resolves_every_algo_key(preset):
    overrides = ["algo.name=ppo"] if preset == "ppo" else [f"algo.preset={preset}"]
    algo = to_dict(load_config(None, overrides))["algo"]
    assert algo == {**ALGO_DEFAULTS, **RESOLVED_PRESETS[preset], "preset": preset}


def test_presets_list_only_what_differs_from_the_defaults():
    """beta is stated by every preset: the default run's (grpo's) 0.04 is not AlgoConfig's 0."""
    for preset, knobs in PRESETS.items():
        restated = [k for k, v in knobs.items() if k != "beta" and getattr(AlgoConfig, k) == v]
        assert not restated, f"{preset} restates defaults: {restated}"


def test_each_section_checks_its_own_fields():
    """The check sits in the section, named by its field: built directly, without the loader, it still applies."""
    with pytest.raises(ValueError, match=r"^steps must be >= 1; got 0$"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match=r"^precision must be one of auto, fp32, bf16; got 'fp16'$"):
        RolloutConfig(precision="fp16")


def test_one_decoding_precision_default_everywhere():
    """rlvr train (rollout.precision), a LocalSampler built by hand, rlvr serve and its Engine decode alike."""
    import inspect

    from rlvr.rollout import LocalSampler
    from rlvr.serve import serve
    from rlvr.serve.engine import Engine

    defaults = {inspect.signature(f).parameters["precision"].default for f in (LocalSampler, serve, Engine)}
    assert defaults == {RunConfig().rollout.precision} == {"auto"}


def test_dapo_and_dr_grpo_settings():
    dapo = load_config(None, ["algo.preset=dapo"]).algo
    assert (dapo.aggregation, dapo.eps_high, dapo.beta) == ("token_mean", 0.28, 0.0)
    dr = load_config(None, ["algo.preset=dr_grpo"]).algo
    assert (dr.scale, dr.aggregation) == ("none", "token_sum_constant")


def test_resolved_config_round_trips(tmp_path):
    from rlvr.config.loading import save_config

    cfg = load_config(None, ["algo.preset=dapo", "train.steps=3"])
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.stepz=3", "unknown config key 'train.stepz'; allowed keys in train: steps,"),
        ("bogus=1", "unknown config key 'bogus'"),
        ("algo.preset=reinforce",
         "algo.preset must be one of grpo, dapo, dr_grpo, gspo, luspo, cispo, sapo, ppo; got 'reinforce'"),
        ("algo.aggregation=mean", "algo.aggregation must be one of sequence_mean, token_mean, token_sum_constant"),
        ("algo.kl_estimator=k9", "algo.kl_estimator must be one of k1, k2, k3"),
        ("task.name=gsm8k", "task.name must be one of arithmetic, word_problems, tool_problems, jsonl"),
        ("train.steps=many", "train.steps must be int, got 'many'"),
        ("rollout.group_size=0", "rollout.group_size must be >= 1"),
        ("rollout.group_size=1", ("rollout.group_size must be >= 2; got 1: GRPO scores each completion against the "
                                 "others of its group, so a group of one has no signal")),
        ("train.steps=-1", "train.steps must be >= 1; got -1"),
        ("train.steps=0", "train.steps must be >= 1; got 0"),
        ("train.steps='1.5'", "train.steps must be int, got '1.5'"),
        ("train.lr=0", "train.lr must be > 0; got 0.0"),
        ("train.warmup_steps=-1", "train.warmup_steps must be >= 0; got -1"),
        ("eval.every=-5", "eval.every must be >= 0; got -5"),
        ("task.eval_size=-1", "task.eval_size must be >= 0; got -1"),
        ("train.heap_threshold_kb=-2", "train.heap_threshold_kb must be >= 0; got -2"),
        ("rollout.precision=fp16", "rollout.precision must be one of auto, fp32, bf16; got 'fp16'"),
        ("model.lora_r=0", "model.lora_r must be >= 1; got 0"),
        ("model.lora_dropout=1", "model.lora_dropout must be in [0, 1); got 1.0"),
        ("rewards=[{name: format, timeout_s: -1}]", "rewards[0].timeout_s must be >= 0"),
        ("task.eval_fraction=0.2", ("task.eval_fraction splits the rows of a file or split (jsonl tasks, hf); "
                                   "task.name=arithmetic makes its own held-out set")),
        ("task.eval_fraction=-0.1", "task.eval_fraction must be in [0, 1)"),
        ("algo.dual_clip=0.5", "algo.dual_clip must be > 1 (or 0 to disable); got 0.5"),
        ("algo.negative_scale=1.5", "algo.negative_scale must be in [0, 1]"),
        ("algo.is_cap=0.5", "algo.is_cap must be >= 1; got 0.5"),
        ("algo.is_mode=clip", "algo.is_mode must be one of truncate, mask; got 'clip'"),
        ("ppo.value_clip=-1", "ppo.value_clip must be >= 0; got -1.0"),
        ("train", "override 'train' must look like key.sub=value"),
        ("log.tensorboard=false", ("log.tensorboard was removed: list the trackers in log.trackers, e.g. "
                                   "log.trackers=[] for none")),
        ("async.max_staleness=-1", "async.max_staleness must be >= 0; got -1"),
        ("rollout.top_p=0", "rollout.top_p must be in (0, 1]; got 0.0"),
        ("rollout.temperature=-1", "rollout.temperature must be >= 0; got -1.0"),
        ("algo.max_resample_rounds=-1", "algo.max_resample_rounds must be >= 0; got -1"),
        ("algo.scale=std", "algo.scale must be one of group, batch, none; got 'std'"),
        ("env.transport=grpc", "env.transport must be one of ws, http; got 'grpc'"),
        ("rewards=[{name: format, on_error: skip}]", "rewards[0].on_error must be one of raise, none; got 'skip'"),
    ],
)
def test_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_jsonl_needs_paths():
    with pytest.raises(ConfigError, match="task.train_path and task.eval_path"):
        load_config(None, ["task.name=jsonl"])
    jsonl = ["task.name=jsonl", "task.train_path=t.jsonl", "rewards=[{name: math_correct}]"]
    assert load_config(None, [*jsonl, "task.eval_fraction=0.1"]).task.eval_fraction == 0.1  # one file, split
    with pytest.raises(ConfigError, match=r"task.eval_fraction=0.1 holds out rows of task.train_path, so it needs "
                                          r"task.train_path and no task.eval_path \(set one of eval_path and "):
        load_config(None, [*jsonl, "task.eval_fraction=0.1", "task.eval_path=e.jsonl"])
    with pytest.raises(ConfigError, match="task.name=math_jsonl needs the gold answer: set task.answer_column"):
        load_config(None, [*jsonl, "task.name=math_jsonl", "task.eval_path=e.jsonl", "task.answer_column="])


def test_empty_config_is_the_demo_task(tmp_path):
    """An empty file (or no file) is a valid config: the demo's arithmetic task (1-digit + and *, 100 of the 200
    questions held out) with its reward; the defaults no longer clash."""
    from rlvr.tasks import load_task

    (tmp_path / "empty.yaml").write_text("")
    cfg = load_config(tmp_path / "empty.yaml")
    assert cfg == load_config(None) == RunConfig()
    assert cfg.task == load_config("examples/demo.yaml").task
    assert [r.name for r in cfg.rewards] == ["arithmetic_correct"]
    train, held_out, check = load_task(cfg.task)
    assert (len(train), len(held_out), check) == (100, 100, "arithmetic_correct")


def test_quoted_numbers_and_booleans_are_read_as_such(tmp_path):
    (tmp_path / "c.yaml").write_text('train:\n  steps: "1"\n  lr: "1e-3"\n  seed: "-2"\nmodel:\n  lora: "false"\n'
                                     'rollout:\n  temperature: "0.5"\ntask:\n  eval_steps: ["2", 3]\n')
    cfg = load_config(tmp_path / "c.yaml")
    assert (cfg.train.steps, cfg.train.lr, cfg.train.seed, cfg.model.lora) == (1, 1e-3, -2, False)
    assert cfg.rollout.temperature == 0.5 and cfg.task.eval_steps == (2, 3)
    for override, message in (("train.steps='1 000'", "train.steps must be int, got '1 000'"),
                              ("train.lr='fast'", "train.lr must be float, got 'fast'"),
                              ("model.lora='yes please'", "model.lora must be bool, got 'yes please'")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, [override])


def test_ppo_has_no_group_size_floor_of_two():
    """PPO's critic is its baseline, so a group of one is a valid PPO run; GRPO's groups need two."""
    assert load_config(None, ["algo.name=ppo", "rollout.group_size=1"]).rollout.group_size == 1


@pytest.mark.parametrize("task, fit", [
    (["task.name=jsonl", "task.train_path=t", "task.eval_path=e"],
     "rewards: [{name: math_correct}] (the final answer against the answer column, via math-verify)"),
    (["task.name=code_jsonl", "task.train_path=t", "task.eval_path=e"], "rewards: [{name: code_tests}]"),
    (["task.name=word_problems"], "rewards: [{name: math_correct}]"),
])
def test_tasks_other_than_arithmetic_list_their_rewards(tmp_path, task, fit):
    """No silent fallback to arithmetic_correct: a task with no rewards listed is an error naming the reward to list."""
    with pytest.raises(ConfigError) as err:
        load_config(None, task)
    name = task[0].split("=")[1]
    assert str(err.value).startswith(f"task.name={name} lists no rewards, and the default, arithmetic_correct, fits "
                                     "only task.name=arithmetic: list the reward that scores your answers, e.g. ")
    assert fit in str(err.value) and "'my_module:my_reward'" in str(err.value) and "\n" not in str(err.value)
    assert load_config(None, [*task, "rewards=[{name: 'tests.helpers:length_reward'}]"]).task.name == name
    (tmp_path / "c.yaml").write_text("rewards:\n  - name: math_correct\n")
    assert load_config(tmp_path / "c.yaml", task).rewards[0].name == "math_correct"


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

    from rlvr.config.schema import AlgoConfig
    from rlvr.core import LossSettings, PPOSettings

    own = set(inspect.get_annotations(AlgoConfig))
    assert not own & {f.name for f in dataclasses.fields(LossSettings)}
    cfg = load_config(None, ["algo.preset=dapo", "algo.dual_clip=3", "ppo.value_clip=0"])
    assert cfg.algo.loss_settings() == LossSettings(eps_high=0.28, aggregation="token_mean", dual_clip=3.0)
    assert type(cfg.algo.loss_settings()) is LossSettings
    assert isinstance(cfg.ppo, PPOSettings) and cfg.ppo.value_clip == 0.0
    assert load_config(None).algo == RunConfig().algo and RunConfig().algo.beta == 0.04


def test_every_rollout_backend_has_one_row():
    """rollout.backend's values and the sampler backends the run builds from are the same set: a backend is one row."""
    from rlvr.config.schema import BACKENDS
    from rlvr.run.build import SAMPLER_BACKENDS

    assert set(SAMPLER_BACKENDS) == set(BACKENDS)
    assert [name for name, b in SAMPLER_BACKENDS.items() if b.in_process] == ["local"]
