"""The C problem set of examples/compiled.yaml: every reference body passes its row's tests through the real
sandbox, and the code_jsonl task reads the rows and picks the compiled_tests reward."""

import json
import sys
from pathlib import Path

import pytest

from rlvr.rewards.compiled import compiled_tests
from rlvr.verifiers.languages import language, missing_tools

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from make_compiled_problems import SOLUTIONS


@pytest.mark.skipif(missing_tools(language("c")) is not None, reason="no C compiler")
def test_every_reference_solution_passes_and_a_constant_fails():
    rows = [json.loads(line) for name in ("c_train.jsonl", "c_eval.jsonl")
            for line in (ROOT / "examples" / "data" / name).read_text().splitlines()]
    assert len(rows) == 34 and set(SOLUTIONS) == {r["name"] for r in rows}
    signature = lambda r: r["prompt"][-1]["content"].split("```c\n")[1].rstrip("`\n").splitlines()[-1]
    answers = [f"```c\n{signature(r)}\n    {SOLUTIONS[r['name']]}\n}}\n```" for r in rows]
    answers += [f"```c\n{signature(r)}\n    return 0;\n}}\n```" for r in rows]
    reward = compiled_tests(language="c", cpu_s=1.0, compile_cpu_s=5.0)
    try:
        scores = reward([r["prompt"] for r in rows] * 2, answers, tests=[r["tests"] for r in rows] * 2)
    finally:
        reward.judge.close()
    assert scores[:34] == [1.0] * 34
    assert scores[34:] == [0.0] * 34  # no problem's tests all expect 0


def test_the_code_jsonl_task_reads_compiled_rows_and_judges_them_with_compiled_tests(tmp_path):
    from rlvr.config.schema import TaskConfig
    from rlvr.tasks import load_task

    cfg = TaskConfig(name="code_jsonl", train_path=str(ROOT / "examples/data/c_train.jsonl"),
                     eval_path=str(ROOT / "examples/data/c_eval.jsonl"), eval_size=6)
    train, held_out, check = load_task(cfg)
    assert (len(train), len(held_out), check) == (18, 6, "compiled_tests")
    assert train[0]["language"] == "c" and train[0]["tests"].startswith("}\nint main(void)")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "language": "cobol", "tests": "t"}) + "\n")
    with pytest.raises(ValueError, match="row 1: unknown language 'cobol'"):
        load_task(TaskConfig(name="code_jsonl", train_path=str(bad), eval_path=str(bad)))
