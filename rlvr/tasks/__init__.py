"""Built-in tasks and dataset loading. A task is a list of rows: ``prompt`` plus answer columns."""

from __future__ import annotations

import torch

from rlvr.config.schema import ARITHMETIC_SYSTEM_PROMPT, TASKS
from rlvr.models.prompts import prompt_token_ids
from rlvr.platform.seeds import epoch_seed
from rlvr.tasks.arithmetic import arithmetic_rows
from rlvr.tasks.columns import STEP_BY_STEP_SYSTEM_PROMPT, ColumnMap, eval_fraction_count, held_out_indices
from rlvr.tasks.hf import hf_rows
from rlvr.tasks.jsonl import load_jsonl, read_jsonl
from rlvr.tasks.tool_problems import SYSTEM_PROMPT as TOOL_SYSTEM_PROMPT
from rlvr.tasks.tool_problems import tool_problem_rows
from rlvr.tasks.word_problems import REASONING_SYSTEM_PROMPT, prompt_head, word_problem_rows
from rlvr.verifiers.code_formats import detect_format
from rlvr.verifiers.languages import language

# JSONL task flavours: whether a gold answer is required (task.answer_column, on every row), the system message of
# question-column prompts when task.system_prompt is left at its default, and the default correctness reward.
JSONL_TASKS = {
    "jsonl": (False, STEP_BY_STEP_SYSTEM_PROMPT, "math_correct"),
    "math_jsonl": (True, STEP_BY_STEP_SYSTEM_PROMPT, "math_correct"),
    "code_jsonl": (False, "", "code_tests"),  # test columns checked by validate_code_rows
}


def load_task(cfg) -> tuple[list[dict], list[dict], str]:
    """Train rows, held-out rows and the name of the correctness reward, from a ``TaskConfig``."""
    if cfg.name == "arithmetic":
        train, held_out = arithmetic_rows(
            cfg.digits, tuple(cfg.operators), cfg.eval_size, cfg.train_size, seed=cfg.seed,
            system_prompt=cfg.system_prompt,
        )
        return train, held_out, cfg.eval_reward or "arithmetic_correct"
    if cfg.name == "word_problems":
        system = REASONING_SYSTEM_PROMPT if cfg.system_prompt == ARITHMETIC_SYSTEM_PROMPT else cfg.system_prompt
        train_steps = tuple(sorted({*cfg.train_steps, *cfg.curriculum}))  # rows for every stage of a curriculum
        train, held_out = word_problem_rows(cfg.eval_size, cfg.train_size, cfg.seed, system, train_steps,
                                            tuple(cfg.eval_steps), cfg.few_shot, cfg.max_number, cfg.grammar)
        return train, held_out, cfg.eval_reward or "math_correct"
    if cfg.name == "tool_problems":
        system = TOOL_SYSTEM_PROMPT if cfg.system_prompt == ARITHMETIC_SYSTEM_PROMPT else cfg.system_prompt
        train, held_out = tool_problem_rows(cfg.eval_size, cfg.train_size, cfg.seed, cfg.problem_kind, cfg.few_shot,
                                            cfg.example_kind or None, system)
        return train, held_out, cfg.eval_reward or "arithmetic_correct"
    if cfg.name in JSONL_TASKS:
        answer_required, system, check = JSONL_TASKS[cfg.name]
        system = system if cfg.system_prompt == ARITHMETIC_SYSTEM_PROMPT else cfg.system_prompt
        columns = ColumnMap.of(cfg, system, answer_required)
        train = load_jsonl(cfg.train_path, columns=columns)
        if cfg.eval_fraction:
            train, held_out = split_off(train, cfg.eval_fraction, cfg.seed, f"task.train_path {cfg.train_path}")
        else:
            held_out = load_jsonl(cfg.eval_path, columns=columns)
        held_out = held_out[: cfg.eval_size]
        if cfg.name == "code_jsonl":
            for path, rows in ((cfg.train_path, train), (cfg.eval_path or cfg.train_path, held_out)):
                validate_code_rows(path, rows)
            if any(_compiled(row) for row in train + held_out):
                check = "compiled_tests"  # rows in C, C++, Rust, Java or JavaScript
        return train, held_out, cfg.eval_reward or check
    if cfg.name == "hf":
        system = STEP_BY_STEP_SYSTEM_PROMPT if cfg.system_prompt == ARITHMETIC_SYSTEM_PROMPT else cfg.system_prompt
        train, held_out = hf_rows(cfg, system)
        return train, held_out, cfg.eval_reward or "math_correct"
    raise ValueError(f"task.name must be one of {', '.join(TASKS)}, got {cfg.name!r}")


def load_extra_eval(cfg, path: str) -> list[dict]:
    """``eval.extra_path``'s rows for the task ``cfg``: word_problems reads ``question`` and ``answer`` and puts each
    question into the task's prompt; the JSONL tasks read the file like their eval_path."""
    if cfg.name == "word_problems":
        system = REASONING_SYSTEM_PROMPT if cfg.system_prompt == ARITHMETIC_SYSTEM_PROMPT else cfg.system_prompt
        head = prompt_head(system, cfg.few_shot, cfg.grammar)
        rows = []
        for lineno, row in read_jsonl(path):
            question, answer = row.get("question"), row.get("answer")
            if not isinstance(question, str) or not question.strip() or not isinstance(answer, (str, int)):
                raise ValueError(f"{path}:{lineno}: eval.extra_path rows for word_problems need a 'question' string "
                                 "and an 'answer' (a string or a whole number)")
            rows.append({"prompt": [*head, {"role": "user", "content": question}], "answer": str(answer)})
        return rows
    if cfg.name in JSONL_TASKS:
        answer_required, system, _ = JSONL_TASKS[cfg.name]
        system = system if cfg.system_prompt == ARITHMETIC_SYSTEM_PROMPT else cfg.system_prompt
        return load_jsonl(path, columns=ColumnMap.of(cfg, system, answer_required))
    raise ValueError(f"eval.extra_path works with task.name word_problems or a JSONL task ({', '.join(JSONL_TASKS)}); "
                     f"task.name is {cfg.name!r}")


def split_off(rows: list[dict], fraction: float, seed: int, where: str) -> tuple[list[dict], list[dict]]:
    """``task.eval_fraction``: (train, held-out) rows, the held-out ones round(fraction x rows) chosen by ``seed``
    (task.seed, so every run with that seed holds out the same rows), both in file order."""
    held = held_out_indices(len(rows), eval_fraction_count(fraction, len(rows), where), seed)
    kept = set(held)
    return [r for i, r in enumerate(rows) if i not in kept], [rows[i] for i in held]


def _compiled(row: dict) -> bool:
    return isinstance(row.get("language"), str) and row["language"].strip().lower() not in ("python", "py", "")


def validate_code_rows(path: str, rows: list[dict]) -> None:
    """Every code row must carry tests in one of the formats of ``rlvr.verifiers.code_formats`` (Python) or, with a
    ``language`` column, of ``rlvr.verifiers.compiled`` (a test program or stdin/stdout cases); all rows alike."""
    kinds = {_compiled(row) for row in rows}
    if len(kinds) > 1:
        raise ValueError(f"{path}: some rows name a compiled language and some do not: one reward judges a file, "
                         "so keep Python rows (code_tests) and compiled-language rows (compiled_tests) apart")
    for i, row in enumerate(rows):
        try:
            _check_compiled_row(row) if _compiled(row) else detect_format(row)
        except ValueError as err:
            raise ValueError(f"{path}: row {i + 1}: {err}") from None


def _check_compiled_row(row: dict) -> None:
    language(row["language"])  # ValueError naming the languages there are
    tests = row.get("tests")
    if isinstance(tests, str) and tests.strip():
        return
    if isinstance(tests, list) and tests and all(
            isinstance(t, dict) and any(isinstance(t.get(k), str) for k in ("input", "stdin"))
            and any(isinstance(t.get(k), str) for k in ("output", "stdout")) for t in tests):
        return
    raise ValueError("compiled-language rows need 'tests': a test program (MultiPL-E's form, a string) or a list of "
                     "{\"input\": str, \"output\": str} cases")


def reward_columns(rows: list[dict], group_size: int) -> dict[str, list]:
    """Every non-prompt column, one value per completion (each row repeated group_size times)."""
    names = sorted({k for r in rows for k in r if k != "prompt"})
    columns = {}
    for name in names:
        for i, r in enumerate(rows):
            if name not in r:
                raise KeyError(f"dataset row {i} ({r['prompt']!r:.80}) has no column {name!r} that other rows have")
        columns[name] = [r[name] for r in rows for _ in range(group_size)]
    return columns


def fit_prompts(tokenizer, rows: list[dict], max_prompt_tokens: int, drop: bool, split: str,
                encode=None, budget: str = "rollout.max_new_tokens") -> tuple[list[dict], int]:
    """Rows whose prompt fits ``max_prompt_tokens``; a longer one is an error naming it, or dropped if ``drop``.
    ``encode``: the prompt's token ids as sampled (default ``prompt_token_ids``; episodes add the tools);
    ``budget``: the setting that takes the rest of the context, named in the error.

    Returns the kept rows and how many were dropped.
    """
    kept = []
    for i, row in enumerate(rows):
        n = len(encode(row["prompt"]) if encode else prompt_token_ids(tokenizer, row["prompt"]))
        if n <= max_prompt_tokens:
            kept.append(row)
        elif not drop:
            raise ValueError(
                f"{split} row {i} has a {n}-token prompt{' with the tools described' if encode else ''}; with "
                f"{budget} the model's context leaves room for {max_prompt_tokens}. Shorten it, lower {budget}, or "
                "set task.drop_long_prompts=true to skip such rows (they are counted)."
            )
    if rows and not kept:  # no rows at all: an eval split of size 0 (no held-out accuracy)
        raise ValueError(f"no {split} prompt fits in {max_prompt_tokens} tokens")
    return kept, len(rows) - len(kept)


def data_order(num_rows: int, seed: int, start: int, count: int) -> list[int]:
    """Row indices at positions [start, start + count) of the data stream: epochs of a seeded permutation, so
    a pure function of (seed, position). A loop that consumes B rows a step reads positions step * B onward."""
    perms: dict[int, torch.Tensor] = {}
    out = []
    for pos in range(start, start + count):
        epoch, offset = divmod(pos, num_rows)
        if epoch not in perms:
            perms[epoch] = torch.randperm(num_rows, generator=torch.Generator().manual_seed(epoch_seed(seed, epoch)))
        out.append(int(perms[epoch][offset]))
    return out


__all__ = [
    "ColumnMap",
    "arithmetic_rows",
    "data_order",
    "fit_prompts",
    "hf_rows",
    "load_extra_eval",
    "load_jsonl",
    "load_task",
    "reward_columns",
    "split_off",
]
