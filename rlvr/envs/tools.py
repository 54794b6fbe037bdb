"""Tools: schemas, tool calls in model output, running a call, counting calls and errors.

A tool is a Python callable with type hints and a Google-style docstring. ``tool_schema`` turns it into the
function schema chat templates render (transformers' ``get_json_schema``, the function TRL uses, so a TRL tool
gets the same schema here). Templates without tool support use the default call format below; the episode
sampler (``rlvr.rollout.episodes``) renders results as ``tool`` turns.

Call format (Hermes/Qwen): ``<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>``.
Text outside the tags is ignored. ``parse_tool_calls`` reads at most ``MAX_SCAN_CHARS`` characters and
``MAX_CALLS`` calls per turn; each malformed call becomes a ``ToolCallError`` in its place.

``run_tool_call`` never raises for anything the model or the tool does: an unknown tool, arguments that do not
bind to the signature, the tool raising, a timeout, a result that cannot be turned into text - each becomes an
``Observation`` whose text the model reads and whose ``kind`` is counted (``KINDS``). A tool that wants to tell
the model what went wrong without a Python type name raises ``ToolError``.

NOT protected: tools run in this process with its permissions. A tool that times out cannot be killed from
Python: it is abandoned in a daemon thread, which may keep a core busy and may still change state the tool
shares (its environment object). Argument values are not checked against the type hints (a tool gets whatever
JSON the model wrote). Building the result text (``json.dumps`` / ``str``) runs in the caller's thread, without
the deadline. Untrusted code belongs to the ``python`` tool, which runs it in the verifiers' process sandbox.
"""

from __future__ import annotations

import inspect
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL_FORMAT = '<tool_call>{"name": "...", "arguments": {...}}</tool_call>'
MAX_SCAN_CHARS = 32_000  # of one model turn
MAX_CALLS = 8  # per model turn
MAX_RESULT_CHARS = 4_000  # of one observation
KINDS = ("ok", "unknown_tool", "bad_arguments", "error", "timeout", "malformed")
ERROR_KINDS = KINDS[1:]
OTHER = "_other"  # stats bucket for calls that name no known tool
ALL = "_all"  # stats totals (public tool names never start with "_")


class ToolError(Exception):
    """Raised by a tool to show the model ``error: <message>`` (no exception type name); counted as ``error``."""


class ToolSchemaError(ValueError):
    pass


def tool_schema(fn: Callable) -> dict:
    """``{"type": "function", "function": {"name", "description", "parameters": {...}}}`` for ``fn`` (a function
    or a bound method), from its type hints and Google-style docstring, exactly as transformers'
    ``get_json_schema`` builds it: ``X | None`` adds ``"nullable": true``, ``Literal`` gives an ``enum``,
    ``"required"`` is left out when every argument has a default, and a return hint adds ``"return"``.
    Raises ``ToolSchemaError`` (one line: the tool and what to fix)."""
    from transformers.utils.chat_template_utils import get_json_schema, parse_google_format_docstring

    name = getattr(fn, "__name__", repr(fn))
    doc = inspect.getdoc(fn)
    if not doc:
        raise ToolSchemaError(f"tool {name}: no docstring; add one (first paragraph: what the tool does, then an "
                              "'Args:' section with one line per argument)")
    try:
        params = [p for p in inspect.signature(fn).parameters.values() if p.name not in ("self", "cls")]
    except (TypeError, ValueError) as err:
        raise ToolSchemaError(f"tool {name}: no signature ({err}); pass a Python function or method") from None
    unhinted = [p.name for p in params if p.annotation is inspect.Parameter.empty]
    if unhinted:
        raise ToolSchemaError(f"tool {name}: argument {unhinted[0]!r} has no type hint; add one (int, float, str, "
                              "bool, list[...], dict, Literal[...] or X | None)")
    described = parse_google_format_docstring(doc.strip())[1]
    undocumented = [p.name for p in params if p.name not in described]
    if undocumented:
        raise ToolSchemaError(f"tool {name}: argument {undocumented[0]!r} is not described in the docstring; add "
                              f"'{undocumented[0]}: <what it is>' under 'Args:'")
    try:
        return get_json_schema(fn)
    except Exception as err:  # noqa: BLE001 (a type hint it cannot convert, an unresolvable annotation)
        why = f"{type(err).__name__}: {_first_line(err, 120)}"
        raise ToolSchemaError(f"tool {name}: cannot build its schema ({why}); use int, float, str, bool, list[...], "
                              "dict, Literal[...] or X | None") from None


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolCallError:
    reason: str  # short, shown to the model
    name: str | None = None  # when the call named a tool before going wrong


def _json_type(value: Any) -> str:
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def _parse_one(body: str) -> ToolCall | ToolCallError:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCallError(f"not valid JSON: {err.msg} at character {err.pos}")
    except RecursionError:
        return ToolCallError("JSON nested too deeply")
    except ValueError:  # an integer over Python's int-str digit limit (4,300 digits by default)
        return ToolCallError("a number too long to read")
    if not isinstance(value, dict):
        return ToolCallError(f"expected a JSON object, got {_json_type(value)}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError('no "name" string')
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return ToolCallError(f'"arguments" must be a JSON object, got {_json_type(arguments)}', name)
    return ToolCall(name, arguments)


def parse_tool_calls(text: str, max_calls: int = MAX_CALLS, max_chars: int = MAX_SCAN_CHARS,
                     ) -> list[ToolCall | ToolCallError]:
    """The calls in one model turn, in order (see the module docstring). Only the first ``max_chars`` characters
    are read; after ``max_calls`` calls one ``ToolCallError`` says the rest were ignored; a ``<tool_call>``
    without ``</tool_call>`` (e.g. cut by the token limit) is a ``ToolCallError``. A ``</tool_call>`` inside a
    JSON string ends the call early (the JSON is then malformed)."""
    scanned = text[:max_chars]
    calls: list[ToolCall | ToolCallError] = []
    pos = 0
    while (start := scanned.find(OPEN, pos)) != -1:
        if len(calls) == max_calls:
            calls.append(ToolCallError(f"more than {max_calls} tool calls in one turn; the rest were ignored"))
            break
        end = scanned.find(CLOSE, start + len(OPEN))
        if end == -1:
            cut = f" (only the first {max_chars} characters are read)" if len(text) > max_chars else ""
            calls.append(ToolCallError(f"{OPEN} without {CLOSE}{cut}"))
            break
        calls.append(_parse_one(scanned[start + len(OPEN):end]))
        pos = end + len(CLOSE)
    return calls


@dataclass(frozen=True)
class Observation:
    tool: str | None  # the known tool the call named, else None
    kind: str  # one of KINDS
    text: str  # what the model reads
    seconds: float = 0.0  # spent running the tool
    truncated: int = 0  # characters cut from the result


def _first_line(err: BaseException, limit: int = 300) -> str:
    lines = str(err).strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[:limit] + "..."


def _as_text(result: Any) -> str:
    """A JSON value (number, bool, None, list, dict) as JSON, a string as itself, anything else with ``str``."""
    if isinstance(result, str):
        return result
    if result is None or isinstance(result, (bool, int, float, list, dict)):
        try:
            return json.dumps(result, ensure_ascii=False)
        except (TypeError, ValueError):  # a list or dict holding other objects
            pass
    return str(result)


def _signature(fn: Callable) -> inspect.Signature | None:
    """The signature with string annotations resolved where possible; None for a callable without one."""
    try:
        return inspect.signature(fn, eval_str=True)
    except Exception:  # noqa: BLE001 (an annotation that does not evaluate: show it as written)
        try:
            return inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin without a signature: the call itself reports bad arguments
            return None


def _call(fn: Callable, arguments: dict[str, Any], timeout_s: float) -> tuple[str, Any]:
    """("value", v), ("error", exception) or ("timeout", None). ``timeout_s`` <= 0: no limit, no thread."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(**arguments)
        except BaseException as err:  # noqa: BLE001 (SystemExit too: a tool must not end the run)
            box["error"] = err

    if timeout_s <= 0:
        run()
        if isinstance(box.get("error"), KeyboardInterrupt):
            raise box["error"]  # Ctrl-C while a tool runs in this thread stops the run
    else:
        worker = threading.Thread(target=run, daemon=True, name="rlvr-tool")
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            return "timeout", None
    return ("error", box["error"]) if "error" in box else ("value", box["value"])


def run_tool_call(call: ToolCall | ToolCallError, tools: dict[str, Callable], timeout_s: float,
                  max_chars: int = MAX_RESULT_CHARS) -> Observation:
    """Run one parsed call; every failure is an ``Observation`` (see the module docstring). ``timeout_s`` <= 0
    runs the tool in this thread without a deadline. A result longer than ``max_chars`` is cut, and says so."""
    known = call.name if call.name in tools else None
    if isinstance(call, ToolCallError):
        return Observation(known, "malformed", f"error: malformed tool call: {call.reason}; write {CALL_FORMAT}")
    if known is None:
        shown = call.name if len(call.name) <= 50 else call.name[:50] + "..."
        return Observation(None, "unknown_tool",
                           f"error: unknown tool {shown!r}; available tools: {', '.join(sorted(tools)) or 'none'}")
    fn = tools[known]
    signature = _signature(fn)
    if signature is not None:
        try:
            signature.bind(**call.arguments)
        except TypeError as err:
            expected = signature.replace(return_annotation=inspect.Signature.empty)
            return Observation(known, "bad_arguments", f"error: bad arguments for {known}: {err}; "
                               f"expected {known}{expected}")
    start = time.perf_counter()
    status, value = _call(fn, call.arguments, timeout_s)
    seconds = time.perf_counter() - start
    if status == "timeout":
        return Observation(known, "timeout", f"error: {known} did not return within {timeout_s:g} s", seconds)
    if status == "error":
        if isinstance(value, ToolError):
            return Observation(known, "error", f"error: {_first_line(value)}", seconds)
        message = _first_line(value)
        return Observation(known, "error", f"error: {known} raised {type(value).__name__}"
                           + (f": {message}" if message else ""), seconds)
    if inspect.isawaitable(value):
        getattr(value, "close", lambda: None)()  # an un-awaited coroutine would warn
        return Observation(known, "error", f"error: {known} is async; rlvr runs only plain functions as tools",
                           seconds)
    try:
        text = _as_text(value)
    except Exception as err:  # noqa: BLE001 (a __str__ that raises, an int over Python's digit limit)
        return Observation(known, "error", f"error: the result of {known} could not be turned into text "
                           f"({type(err).__name__}: {_first_line(err)})", seconds)
    cut = max(0, len(text) - max_chars)
    if cut:
        text = text[:max_chars] + f"\n[truncated: {cut} more characters]"
    return Observation(known, "ok", text, seconds, cut)


@dataclass
class ToolStats:
    """Calls, errors by kind, seconds and truncated results per tool, summed over episodes (``record``,
    ``merge``). Calls naming no known tool count under ``_other``; totals under ``_all``."""

    calls: Counter = field(default_factory=Counter)  # tool -> calls
    errors: Counter = field(default_factory=Counter)  # (tool, kind) -> calls
    seconds: Counter = field(default_factory=Counter)  # tool -> seconds running it
    truncated: Counter = field(default_factory=Counter)  # tool -> results cut

    def record(self, obs: Observation) -> None:
        tool = obs.tool or OTHER
        self.calls[tool] += 1
        if obs.kind != "ok":
            self.errors[tool, obs.kind] += 1
        if obs.seconds:
            self.seconds[tool] += obs.seconds
        if obs.truncated:
            self.truncated[tool] += 1

    def merge(self, other: ToolStats) -> None:
        self.calls.update(other.calls)
        self.errors.update(other.errors)
        self.seconds.update(other.seconds)
        self.truncated.update(other.truncated)

    def as_metrics(self) -> dict[str, float]:
        """``calls/<tool>``, ``errors/<tool>/<kind>``, ``seconds/<tool>``, ``truncated/<tool>`` for what happened;
        ``calls/_all`` and ``errors/_all/<kind>`` for every error kind always (0.0 when none), so a plot has
        a value at every step."""
        row = {f"calls/{ALL}": float(sum(self.calls.values()))}
        row |= {f"errors/{ALL}/{kind}": float(sum(n for (_, k), n in self.errors.items() if k == kind))
                for kind in ERROR_KINDS}
        row |= {f"calls/{tool}": float(n) for tool, n in sorted(self.calls.items())}
        row |= {f"errors/{tool}/{kind}": float(n) for (tool, kind), n in sorted(self.errors.items())}
        row |= {f"seconds/{tool}": float(s) for tool, s in sorted(self.seconds.items())}
        row |= {f"truncated/{tool}": float(n) for tool, n in sorted(self.truncated.items())}
        return row
