"""The curriculum over operation counts: stages end on the pass rate or the step cap; the data stream skips the
rows of other stages, deterministically and without losing its place."""

import pytest

from rlvr.config.loading import ConfigError, load_config
from rlvr.run.curriculum import Curriculum, stage_row_ids
from rlvr.tasks import data_order


def test_stage_ends_after_three_passing_steps_or_the_cap():
    c = Curriculum(stages=((1,), (2,), (2, 3)), pass_rate=0.5, max_stage_steps=4)
    state: dict = {}
    assert c.allowed(state) == (1,)
    for rate in (0.6, 0.4, 0.5):  # the 0.4 breaks the run of three
        c.record(state, rate)
    assert c.allowed(state) == (1,) and state["curriculum_stage_taken"] == 3
    c.record(state, 0.7)  # 0.4, 0.5, 0.7 does not pass, but it is the stage's fourth step: the cap
    assert c.allowed(state) == (2,)
    state = {}
    for rate in (0.4, 0.6, 0.5):
        c.record(state, rate)
    assert c.allowed(state) == (1,)
    c.record(state, 0.9)  # 0.6, 0.5, 0.9: three in a row at >= 0.5
    assert c.allowed(state) == (2,) and state["curriculum_recent"] == []
    for _ in range(3):
        c.record(state, 0.0)
    assert c.allowed(state) == (2,)
    c.record(state, 0.0)  # the fourth step in the stage: the cap
    assert c.allowed(state) == (2, 3)
    for _ in range(10):
        c.record(state, 1.0)
    assert c.allowed(state) == (2, 3)  # the last stage lasts


def test_a_checkpoint_state_from_another_curriculum_is_refused():
    c = Curriculum(stages=((1,), (2, 3)), pass_rate=0.5, max_stage_steps=4)
    for bad in (2, -1, "1", 1.0):
        with pytest.raises(ValueError, match="curriculum stage .* which task.curriculum \\(stages 0-1\\)"):
            c.allowed({"curriculum_stage": bad})
    for history in ({"curriculum_recent": "x"}, {"curriculum_recent": [None]}, {"curriculum_stage_taken": "3"}):
        with pytest.raises(ValueError, match="malformed curriculum history"):
            c.record(dict(history), 0.5)


def test_rows_of_other_stages_are_skipped_in_stream_order():
    rows = [{"steps": s} for s in (1, 2, 2, 1, 3, 2, 1, 2, 3, 1)]
    order = lambda start, n: data_order(len(rows), 5, start, n)
    stream = data_order(len(rows), 5, 0, 30)
    state = {"cursor": 0}
    got = stage_row_ids(rows, (2,), 3, state, order) + stage_row_ids(rows, (2,), 3, state, order)
    want = [i for i in stream if rows[i]["steps"] == 2][:6]  # naive: filter the stream
    assert got == want
    assert stream[state["cursor"] - 1] == want[-1]  # the cursor stops right after the last row taken
    with pytest.raises(ValueError, match="no training row has \\(4,\\) operations"):
        stage_row_ids(rows, (4,), 1, {"cursor": 0}, order)
    with pytest.raises(ValueError, match="needs a 'steps' column"):
        stage_row_ids([{"x": 1}], (1,), 1, {"cursor": 0}, order)


def test_config_refuses_a_curriculum_it_cannot_run():
    with pytest.raises(ConfigError, match="task.curriculum runs in the synchronous GRPO loop"):
        load_config(None, ["task.name=word_problems", "task.curriculum=[1]", "async.enabled=true", "model.lora=true",
                           "rewards=[{name: math_correct}]"])
    with pytest.raises(ConfigError, match="curriculum_pass_rate must be in"):
        load_config(None, ["task.name=word_problems", "task.curriculum=[1]", "task.curriculum_pass_rate=0",
                           "rewards=[{name: math_correct}]"])
