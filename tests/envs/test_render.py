"""Tools reach the prompt through the template when it renders them, else as rlvr's default system instruction."""

import copy
import json

from rlvr.envs.render import template_renders_tools, tools_instruction, with_tools
from rlvr.envs.tools import CALL_FORMAT

SCHEMA = {"type": "function", "function": {"name": "calculator", "description": "Exact arithmetic.",
                                           "parameters": {"type": "object", "properties": {}}}}
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t['function']['name'] }}\n{% endfor %}"
                  "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_ignores_tools_gets_the_default_instruction(tokenizer):
    assert not template_renders_tools(tokenizer)  # the test template, like SmolLM2's, has no tools block
    messages = [{"role": "user", "content": "6 * 7?"}]
    rendered, tools = with_tools(messages, [SCHEMA], template_renders_tools(tokenizer))
    assert tools is None and rendered[1:] == messages and rendered[0]["role"] == "system"
    assert rendered[0]["content"] == tools_instruction([SCHEMA])
    assert CALL_FORMAT in rendered[0]["content"] and json.dumps(SCHEMA, separators=(",", ":")) in rendered[0]["content"]
    system = [{"role": "system", "content": "Be brief."}, *messages]
    rendered, _ = with_tools(system, [SCHEMA], False)
    assert rendered[0]["content"] == "Be brief.\n\n" + tools_instruction([SCHEMA]) and rendered[1:] == messages


def test_a_template_that_renders_tools_gets_them_as_they_are(tokenizer):
    capable = copy.deepcopy(tokenizer)
    capable.chat_template = TOOLS_TEMPLATE
    assert template_renders_tools(capable)
    messages = [{"role": "user", "content": "6 * 7?"}]
    assert with_tools(messages, [SCHEMA], True) == (messages, [SCHEMA])
    assert with_tools(messages, [], False) == (messages, None)


def test_no_template_renders_no_tools(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    assert not template_renders_tools(plain)
