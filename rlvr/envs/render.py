"""Telling the model which tools it has: through the chat template when the template renders ``tools=``, else a
system message in rlvr's default format (a JSON call inside ``<tool_call>…</tool_call>``, results as ``tool`` turns).

SmolLM2's template, like many small models', ignores ``tools=``: ``template_renders_tools`` finds that out by
rendering a probe, so the default is used exactly where the template would drop the tools silently.
"""

from __future__ import annotations

import json

from rlvr.envs.tools import CALL_FORMAT

DEFAULT_INSTRUCTION = (
    "You can call tools. To call one, write {call_format} on its own, with the tool's name and a JSON object of its "
    "arguments; the result comes back in the next message. Call a tool when it helps, then give the final answer "
    "without a tool call. Tools (JSON schemas):\n{schemas}"
)


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template puts the ``tools=`` it is given into the prompt."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    probe = {"type": "function", "function": {"name": "rlvr_probe_tool_x7", "description": "probe",
                                              "parameters": {"type": "object", "properties": {}}}}
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}], tools=[probe], tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # noqa: BLE001 (a template that cannot take tools does not render them)
        return False
    return "rlvr_probe_tool_x7" in text


def tools_instruction(schemas: list[dict]) -> str:
    """The default system text that describes ``schemas`` and the call format."""
    return DEFAULT_INSTRUCTION.format(call_format=CALL_FORMAT,
                                      schemas="\n".join(json.dumps(s, separators=(",", ":")) for s in schemas))


def with_tools(messages: list[dict], schemas: list[dict], template_tools: bool) -> tuple[list[dict], list | None]:
    """(messages, tools) to render a prompt with: the template's own ``tools=`` (``template_tools``), or the
    default instruction at the start of the system message (one is added when the prompt has none)."""
    if template_tools or not schemas:
        return messages, schemas or None
    text = tools_instruction(schemas)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]], None
    return [{"role": "system", "content": text}, *messages], None
