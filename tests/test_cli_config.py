"""`rlvr config [SECTION | SECTION.KEY]` prints the config's keys from the field docstrings; `rlvr train --help` says
where keys, tasks, rewards and data formats are documented."""

import dataclasses
import re

import pytest

from rlvr.cli import main
from rlvr.config.doc import all_fields, field_doc
from rlvr.config.schema import AlgoConfig, RewardConfig


def _run(capsys, *argv):
    code = main(["config", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_every_key_is_listed(capsys):
    code, out, _ = _run(capsys)
    assert code == 0
    listed = [m.group(1) for line in out.splitlines() if (m := re.match(r"  ([\w.\[\]]+): ", line))]
    assert listed == [f.key for f in all_fields()] and len(listed) > 100  # one line per key, in order
    for section in ("top level", "model", "task", "rewards", "rollout", "algo", "ppo", "train", "eval", "log",
                    "async"):
        assert any(line.startswith(f"{section}: ") for line in out.splitlines()), section


def test_one_section(capsys):
    code, out, _ = _run(capsys, "rewards")
    assert code == 0
    assert out.splitlines()[0] == "rewards: Reward functions and weights; the total is their weighted sum."
    keys = [line.split(":")[0].strip() for line in out.splitlines() if line.startswith("  rewards[].")]
    assert keys == [f"rewards[].{f.name}" for f in dataclasses.fields(RewardConfig)]
    assert "algo." not in out


def test_one_key_with_type_default_presets_and_docstring(capsys):
    code, out, _ = _run(capsys, "algo.beta")
    doc, _ = field_doc(AlgoConfig, "beta")
    assert code == 0
    assert out.splitlines()[0] == "  algo.beta: float = 0.04"  # what a config that does not set it trains with
    assert ("set by algo.preset unless the config sets it: grpo 0.04, dapo 0.0, dr_grpo 0.0, gspo 0.0, luspo 0.0, "
            "cispo 0.0, sapo 0.0, ppo 0.0") in " ".join(out.split())  # wrapped
    assert " ".join(out.split()[-len(doc.split()):]) == doc  # the docstring, wrapped
    code, out, _ = _run(capsys, "rewards.kwargs")  # a list section's key, with or without []
    assert code == 0 and out.splitlines()[0] == "  rewards[].kwargs: mapping = {}"


@pytest.mark.parametrize("target, message", [
    ("algo.bta", "no config key 'algo.bta'; did you mean algo.beta? (the keys of algo: algo.name, algo.preset, "),
    ("algp", "no config section or key 'algp'; did you mean algo? (sections: top level, model, task, rewards, "),
])
def test_unknown_names_are_one_line(capsys, target, message):
    code, out, err = _run(capsys, target)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"rlvr: error: {message}")


def test_train_help_points_at_keys_and_docs(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for text in ("rlvr config", "rlvr config algo.beta", "docs/reference/config.md", "docs/concepts/rewards_data.md",
                 "my_rewards:my_reward", "the config's folder"):
        assert text in out, text
