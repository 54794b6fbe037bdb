"""Security review (issue 39), resuming from a run directory someone else wrote: a YAML alias bomb in a checkpoint's
config.yaml, state.json fields of the wrong type or range, a planted symbolic link and a FIFO among the run's files.
One real two-step run (tiny random model) is copied for each case, planted with one thing, and resumed: each stops
before training with one line, and nothing outside the run is written."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from rlvr.config.loading import ConfigError, build_config, config_changes, load_config, load_yaml
from rlvr.launch import train
from rlvr.run.resume_checks import ResumeError, check_loop_state
from tests.test_resume import ROOT, _overrides

STEP = "step-00000002"


def alias_bomb(levels: int) -> str:
    """``levels`` lists of nine aliases each to the previous: 9**levels leaves from a few hundred bytes (levels=9:
    387 million, the review's 902-byte bomb)."""
    text = 'a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]\n'
    for i in range(1, levels):
        text += f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]\n"
    return text + f"model: {{name: *a{levels - 1}}}\n"


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "run"
    base = _overrides(tiny_model_dir, out, True) + ["eval.every=0", "train.steps=2"]
    train(load_config(ROOT / "examples" / "demo.yaml", base))
    return out, base


@pytest.fixture
def run(trained, tmp_path):
    """A copy of the trained run and the overrides that resume it for one more step."""
    source, base = trained
    out = tmp_path / "run"
    shutil.copytree(source, out, symlinks=True)
    return out, [b for b in base if not b.startswith(("output_dir=", "train.steps="))] + [
        f"output_dir={out}", "train.steps=3", "resume=auto"]


def resume(overrides):
    train(load_config(ROOT / "examples" / "demo.yaml", overrides))


def rewrite(checkpoint: Path, name: str, text: str) -> None:
    """Replace a checkpoint file and its manifest entry, as anyone with write access can."""
    (checkpoint / name).write_text(text)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    data = text.encode()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def test_an_alias_bomb_is_refused_before_anything_walks_it():
    assert len(alias_bomb(9)) < 1000
    with pytest.raises(ConfigError, match=r"^bomb, line 2: a YAML alias \(\*name\); rlvr reads no aliases"):
        load_yaml(alias_bomb(9), "bomb")
    assert load_yaml("a: &anchor 1\nb: 2\n", "plain") == {"a": 1, "b": 2}  # an anchor alone is harmless


def test_config_changes_refuses_an_alias_bomb():
    with pytest.raises(ConfigError, match=r"^the checkpoint's config\.yaml, line 2: a YAML alias"):
        config_changes(alias_bomb(3), build_config({}))  # 729 leaves: fast before the fix too, and accepted


def test_resume_stops_on_an_alias_bomb_in_the_checkpoints_config(run):
    out, overrides = run
    rewrite(out / "checkpoints" / STEP, "config.yaml", alias_bomb(4))
    with pytest.raises(ConfigError, match=r"config\.yaml, line 2: a YAML alias"):
        resume(overrides)


@pytest.mark.parametrize("field, value, why", [
    ("cursor", -4, "must be an integer in [0, 2^53], not -4"),
    ("cursor", 2 ** 70, "must be an integer in [0, 2^53], not 1180591620717411303424"),
    ("skipped_updates", "7", "must be an integer in [0, 2^53], not '7'"),
    ("consecutive_skips", True, "must be an integer in [0, 2^53], not True"),
    ("elapsed_s", None, "must be a finite number of seconds >= 0, not None"),
    ("eval_accuracy", 1.5, "must be null or a number in [0, 1], not 1.5"),
    ("eval_accuracy_before", "\x1b[2Jhigh", "must be null or a number in [0, 1], not '\\x1b[2Jhigh'"),
    ("pending", [3, 3], "must be a list of distinct integers in [0, 2^53]"),
    ("curriculum_recent", [0.5, 2], "must be a list of pass rates in [0, 1]"),
])
def test_loop_state_fields_are_checked(field, value, why):
    state = {"cursor": 4, "skipped_updates": 0, "consecutive_skips": 0, "elapsed_s": 1.5, "eval_accuracy": None,
             "eval_accuracy_before": 0.25, "dropped_prompts": 0, "pending": [1, 2], "curriculum_recent": [0.5]}
    assert check_loop_state(dict(state), Path("ck")) == state
    with pytest.raises(ResumeError) as caught:
        check_loop_state({**state, field: value}, Path("ck"))
    assert str(caught.value) == f"checkpoint ck: state.json field {field!r} {why}; resume from another checkpoint"


def test_resume_stops_on_a_bad_state_field(run):
    out, overrides = run
    checkpoint = out / "checkpoints" / STEP
    state = json.loads((checkpoint / "state.json").read_text())
    rewrite(checkpoint, "state.json", json.dumps({**state, "elapsed_s": "soon"}))
    with pytest.raises(ResumeError, match=r"state\.json field 'elapsed_s' must be a finite number"):
        resume(overrides)


def test_a_number_no_float_holds_in_eval_first_is_the_one_line_refusal(run):
    """A 401-digit integer among the first evaluation's metrics or scores raised OverflowError out of the check (a
    traceback); -1e300 passed as finite. Each is now the one-line refusal naming the field."""
    out, overrides = run
    checkpoint = out / "checkpoints" / STEP
    state = json.loads((checkpoint / "state.json").read_text())
    record = {"step": 0, "metrics": {"eval/accuracy": 0.5}, "replies": [{"prompt": "p", "reply": "r",
                                                                          "scores": {"check": 1.0}}]}
    assert check_loop_state({"eval_first": record}, Path("ck"))
    for bad in ({**record, "metrics": {"eval/accuracy": 10 ** 400}},
                {**record, "replies": [{"prompt": "p", "reply": "r", "scores": {"check": -1e300}}]}):
        with pytest.raises(ResumeError, match="field 'eval_first' must be an evaluation record"):
            check_loop_state({"eval_first": bad}, Path("ck"))
    rewrite(checkpoint, "state.json", json.dumps({**state, "eval_first": {**record, "metrics": {"m": 10 ** 400}}}))
    with pytest.raises(ResumeError) as caught:
        resume(overrides)
    assert "\n" not in str(caught.value) and "state.json field 'eval_first'" in str(caught.value)


def test_a_planted_link_is_refused_and_the_outside_file_kept(run, tmp_path):
    out, overrides = run
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me\n")
    (out / "metrics.tmp").symlink_to(outside)  # what resume's metrics.jsonl rewrite writes, then renames
    with pytest.raises(ResumeError, match=rf"^{out / 'metrics.tmp'} is a symbolic link; a run directory holds none"):
        resume(overrides)
    assert outside.read_text() == "keep me\n"
    (out / "metrics.tmp").unlink()
    (out / "adapter" / "adapter_model.safetensors").unlink()
    (out / "adapter" / "adapter_model.safetensors").symlink_to(outside)  # what the end of the run saves
    with pytest.raises(ResumeError, match=r"adapter_model\.safetensors is a symbolic link"):
        resume(overrides)
    assert outside.read_text() == "keep me\n"


def test_a_fifo_among_the_run_files_is_refused_unopened(run):
    out, overrides = run
    fifo = out / "metrics.jsonl"
    fifo.unlink()
    os.mkfifo(fifo)  # before the fix, resume blocked here for good, opening it
    with pytest.raises(ResumeError, match=rf"^{fifo} is a FIFO, not a regular file"):
        resume(overrides)
