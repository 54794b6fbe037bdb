"""Shared fixtures: a tiny random Llama and a tiny byte-level BPE tokenizer, built in-process (no downloads)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):  # make test: one worker per core, one torch thread each
    torch.set_num_threads(1)

# trackio reads TRACKIO_DIR once, when first imported - and importing TRL's trainer imports it: each test process
# gets a directory of its own before anything can, never the user's ~/.cache (tests/test_trackers.py counts runs)
if "TRACKIO_DIR" not in os.environ:
    os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="rlvr-tests-trackio-")
    atexit.register(shutil.rmtree, os.environ["TRACKIO_DIR"], True)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(corpus: tuple[str, ...] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = list(corpus) or ["What is 3 + 4? The answer is 7. 12 * 9 = 108",
                              "system user assistant Reply with only the number."]
    tok.train_from_iterator(corpus * 20, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


def make_model(vocab_size: int, seed: int = 0, dtype=torch.float32, context: int = 256):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config).to(dtype)


@pytest.fixture(scope="session")
def tokenizer():
    tok = make_tokenizer()
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A saved tiny random Llama + tokenizer, loadable by rlvr like any local model."""
    path = tmp_path_factory.mktemp("tiny-llama")
    make_model(len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_long_model_dir(tmp_path_factory, tokenizer):
    """The tiny random Llama with a 2048-token context: room for a tool description (episodes) in the tiny
    tokenizer's long tokenization."""
    path = tmp_path_factory.mktemp("tiny-llama-long")
    make_model(len(tokenizer), context=2048).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def sample_tiny(model, tokenizer, prompts, group_size, params, seed=0, eos_every=0, version=0):
    """Groups sampled in-process from a tiny model; ``eos_every=k`` makes every k-th token id an EOS so that
    completions end at varied lengths."""
    from rlvr.rollout import sample_groups

    model.generation_config.eos_token_id = list(range(0, len(tokenizer), eos_every)) if eos_every else 2
    return sample_groups(model, tokenizer, prompts, group_size, params, torch.Generator().manual_seed(seed), version)
