"""Reward functions named 'module:function' import like Python does: from the working directory, then the config's
folder, then sys.path; every failure to build one is a single line naming the module, the function and what to do."""

import json
import sys
import textwrap
import uuid

import pytest
import yaml

from rlvr.cli import main
from rlvr.rewards import RewardError, RewardImportError, build_reward, reward_search_path
from rlvr.store.metrics import read_metrics
from tests.test_e2e import _overrides


@pytest.fixture(autouse=True)
def _restore_imports(monkeypatch):
    """Each test's changes to sys.path, the search folders and the imported rw_* modules are undone after it."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    reward_search_path([])
    for name in set(sys.modules) - before:
        if name.startswith("rw_"):
            del sys.modules[name]


def _module(folder, source, stem="rw"):
    """Write a module with a fresh name into ``folder``; return its name."""
    name = f"{stem}_{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(textwrap.dedent(source))
    return name


CONSTANT = """
    def reward(prompts, completions, **columns):
        return [{value}] * len(completions)


    def scaled(prompts, completions, scale=1.0, **columns):
        return [scale * len(c) for c in completions]


    def strict(prompts, completions, scale):
        return [scale] * len(completions)


    def _private(prompts, completions, **columns):
        return []


    LIMIT = 3
"""


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("rlvr: error: ")
    return err.removeprefix("rlvr: error: ").rstrip("\n")


def test_imports_from_the_working_directory(tmp_path, monkeypatch):
    name = _module(tmp_path, CONSTANT.format(value=0.5))
    monkeypatch.chdir(tmp_path)
    assert build_reward(f"{name}:reward")(["p", "q"], ["a", "b"]) == [0.5, 0.5]


def test_imports_from_the_config_folder_after_the_working_directory(tmp_path, monkeypatch):
    cwd, config_dir = tmp_path / "cwd", tmp_path / "configs"
    only_there = _module(config_dir, CONSTANT.format(value=2.0))
    both = _module(config_dir, CONSTANT.format(value=2.0))
    (cwd / f"{both}.py").parent.mkdir()
    (cwd / f"{both}.py").write_text(textwrap.dedent(CONSTANT.format(value=1.0)))
    monkeypatch.chdir(cwd)
    assert reward_search_path([config_dir]) == (cwd.resolve(), config_dir.resolve())
    assert build_reward(f"{only_there}:reward")(None, ["a"]) == [2.0]
    assert build_reward(f"{both}:reward")(None, ["a"]) == [1.0]  # the working directory comes first
    # after the import the folders stay importable, at the end of sys.path (they shadow no library)
    assert sys.path[-2:] == [str(cwd.resolve()), str(config_dir.resolve())]


def test_kwargs_are_bound_and_checked(tmp_path, monkeypatch):
    name = _module(tmp_path, CONSTANT.format(value=0))
    monkeypatch.chdir(tmp_path)
    assert build_reward(f"{name}:scaled", {"scale": 2.0})(None, ["ab", "abc"]) == [4.0, 6.0]
    with pytest.raises(RewardImportError) as err:
        build_reward(f"{name}:strict", {"scael": 2.0})
    assert str(err.value) == (f"reward '{name}:strict': kwargs {{'scael': 2.0}} do not fit {name}.strict (got an "
                              "unexpected keyword argument 'scael'); the keyword arguments it takes: scale")
    with pytest.raises(RewardImportError) as err:
        build_reward("format", {"patern": "x"})
    assert str(err.value) == ("reward 'format': kwargs {'patern': 'x'} do not fit the built-in format (got an "
                              "unexpected keyword argument 'patern'); the keyword arguments it takes: pattern")


def test_module_not_found_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    reward_search_path([tmp_path / "configs"])
    with pytest.raises(RewardImportError) as err:
        build_reward("rw_absent:my_reward")
    assert str(err.value) == (
        f"reward 'rw_absent:my_reward': no module named 'rw_absent' in {tmp_path.resolve()} (the working directory), "
        f"{(tmp_path / 'configs').resolve()} or on sys.path; put rw_absent.py in the working directory or the "
        "config's folder, install the package that provides it, or add its folder to PYTHONPATH")
    assert isinstance(err.value, ValueError)  # callers that caught ValueError still do


def test_module_whose_own_import_fails_names_that_error(tmp_path, monkeypatch):
    missing_dependency = _module(tmp_path, "import rw_not_installed_anywhere\n")
    raising = _module(tmp_path, "LIMIT = 1\nraise RuntimeError('no GPU here')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardImportError) as err:
        build_reward(f"{missing_dependency}:reward")
    assert str(err.value) == (
        f"reward '{missing_dependency}:reward': importing module '{missing_dependency}' failed at "
        f"{tmp_path / missing_dependency}.py:1: ModuleNotFoundError: No module named 'rw_not_installed_anywhere' "
        "(a module it imports is missing: install it)")
    with pytest.raises(RewardImportError) as err:
        build_reward(f"{raising}:reward")
    assert str(err.value) == (f"reward '{raising}:reward': importing module '{raising}' failed at "
                              f"{tmp_path / raising}.py:2: RuntimeError: no GPU here")
    syntax = _module(tmp_path, "def reward(:\n")
    with pytest.raises(RewardImportError) as err:
        build_reward(f"{syntax}:reward")
    assert str(err.value) == (f"reward '{syntax}:reward': importing module '{syntax}' failed at "
                              f"{tmp_path / syntax}.py:1: SyntaxError: invalid syntax ({syntax}.py, line 1)")


def test_missing_function_lists_the_public_callables(tmp_path, monkeypatch):
    name = _module(tmp_path, CONSTANT.format(value=0))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardImportError) as err:
        build_reward(f"{name}:rewad")
    assert str(err.value) == (f"reward '{name}:rewad': module '{name}' ({tmp_path / name}.py) has no function "
                              "'rewad'; its public callables: reward, scaled, strict")
    with pytest.raises(RewardImportError, match=f"reward '{name}:LIMIT': {name}.LIMIT is a int, not a function"):
        build_reward(f"{name}:LIMIT")


def test_main_names_a_function_of_the_running_script(monkeypatch):
    def script_reward(prompts, completions, **columns):
        return [1.0 for _ in completions]

    monkeypatch.setattr(sys.modules["__main__"], "rw_script_reward", script_reward, raising=False)
    assert build_reward("__main__:rw_script_reward") is script_reward
    with pytest.raises(RewardImportError, match="__main__ is the program that is running .* works only from your own "
                                                "script that defines the function and calls rlvr.launch.train"):
        build_reward("__main__:rw_not_defined")


def test_names_that_are_not_rewards():
    with pytest.raises(RewardImportError, match=r"^unknown reward 'nope': use a built-in \(arithmetic_correct, "):
        build_reward("nope")
    with pytest.raises(RewardImportError, match="^reward 'rw_mod:': write a function of your own as "
                                                "'package.module:function'$"):
        build_reward("rw_mod:")


def _config(folder, reward, tiny_model_dir, out):
    """A config file in ``folder`` whose reward is ``reward`` (the end-to-end tests' settings, 1 step, 2 held out)."""
    data: dict = {}
    overrides = _overrides(tiny_model_dir, out) + [f"rewards=[{{name: '{reward}'}}]", "train.steps=1", "eval.every=0",
                                                   "task.eval_size=2"]
    for override in overrides:
        key, value = override.split("=", 1)
        *sections, name = key.split(".")
        node = data
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = yaml.safe_load(value)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_cli_train_imports_from_the_config_folder(tiny_model_dir, tmp_path, monkeypatch, capsys):
    config_dir = tmp_path / "experiment"
    name = _module(config_dir, CONSTANT.format(value=0.75))
    path = _config(config_dir, f"{name}:reward", tiny_model_dir, tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["train", str(path)]) == 0
    step = read_metrics(tmp_path / "run" / "metrics.jsonl")[1]
    assert step["rollout/reward_mean"] == 0.75  # every completion scored 0.75 by the module next to the config


def test_cli_eval_imports_from_the_config_folder(tiny_model_dir, tmp_path, monkeypatch, capsys):
    config_dir = tmp_path / "experiment"
    name = _module(config_dir, CONSTANT.format(value=1.0))
    path = _config(config_dir, "arithmetic_correct", tiny_model_dir, tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    assert main(["eval", str(path), f"task.eval_reward={name}:reward"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["eval_accuracy"] == 1.0 and result["eval_size"] == 2  # the check scores every answer 1.0


def test_cli_reward_not_found_is_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    config_dir = tmp_path / "experiment"
    path = _config(config_dir, "rw_my_rewards:my_reward", tiny_model_dir, tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(path)]) == 2
    assert _one_line(capsys) == (
        f"reward 'rw_my_rewards:my_reward': no module named 'rw_my_rewards' in {tmp_path.resolve()} (the working "
        f"directory), {config_dir.resolve()} or on sys.path; put rw_my_rewards.py in the working directory or the "
        "config's folder, install the package that provides it, or add its folder to PYTHONPATH")


def test_cli_reward_import_errors_are_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    config_dir = tmp_path / "experiment"
    broken = _module(config_dir, "import rw_not_installed_anywhere\n")
    defined = _module(config_dir, CONSTANT.format(value=0))
    monkeypatch.chdir(tmp_path)
    path = _config(config_dir, f"{broken}:reward", tiny_model_dir, tmp_path / "run")
    assert main(["train", str(path)]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"reward '{broken}:reward': importing module '{broken}' failed at ")
    assert line.endswith(": ModuleNotFoundError: No module named 'rw_not_installed_anywhere' (a module it imports "
                         "is missing: install it)")
    assert main(["train", str(path), f"rewards=[{{name: '{defined}:rewad'}}]"]) == 2
    assert _one_line(capsys) == (f"reward '{defined}:rewad': module '{defined}' ({config_dir / defined}.py) has no "
                                 "function 'rewad'; its public callables: reward, scaled, strict")


def test_reward_error_is_the_cli_s_class():
    assert issubclass(RewardImportError, RewardError)


def test_a_local_module_wins_over_an_installed_one_whatever_was_imported_before(tmp_path, monkeypatch):
    """The working directory goes first for every import, not only the first one; sys.path is left as it was, with
    the folders at its end."""
    work, site = tmp_path / "work", tmp_path / "site"
    first = _module(work, CONSTANT.format(value=1.0))
    name = _module(site, CONSTANT.format(value=2.0))
    (work / f"{name}.py").write_text(textwrap.dedent(CONSTANT.format(value=3.0)))  # same name, in the work folder
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(site))
    before = list(sys.path)
    assert build_reward(f"{first}:reward")([""], ["x"]) == [1.0]
    assert build_reward(f"{name}:reward")([""], ["x"]) == [3.0]  # the local file, not the one on sys.path
    assert sys.path[: len(before)] == before
