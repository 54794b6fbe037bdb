"""Write a benchmark's JSON and replace its section of BENCHMARKS.md (between marker comments)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def publish(name: str, results: dict, markdown: str) -> None:
    out = ROOT / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    path = ROOT / "BENCHMARKS.md"
    text = path.read_text() if path.is_file() else "# Benchmarks\n\nEach section is rewritten by the script it names.\n"
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{markdown.strip()}\n{end}"
    if start in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
