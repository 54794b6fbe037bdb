"""Tiny random models of the common causal-LM families, each with the features that set its output apart from
Llama's: sliding-window attention, final-logit soft-capping, logit scaling, fused projections, MoE experts.

Sizes are tiny (hidden 32, 2-4 layers) so a family builds in milliseconds; windows are 8 tokens so a test's
sequences are longer than them. Soft-capping and logit scales are set where the tiny model's logits feel them.
"""

from __future__ import annotations

import torch

SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 512}
IDS = {"eos_token_id": 2, "pad_token_id": 0, "bos_token_id": 1}


def _config(family: str, vocab: int):
    import transformers as tf

    common = dict(vocab_size=vocab, **SMALL, **IDS)
    if family == "llama":
        return tf.LlamaConfig(**common)
    if family == "qwen2":
        return tf.Qwen2Config(**common)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=8)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 decoder_sparse_step=1, norm_topk_prob=True)
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=8)
    if family == "gemma2":
        return tf.Gemma2Config(**common, head_dim=8, sliding_window=8, final_logit_softcapping=0.5,
                               attn_logit_softcapping=50.0, query_pre_attn_scalar=8)
    if family == "gemma3":
        return tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 3}, head_dim=8, sliding_window=8,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                   query_pre_attn_scalar=8)
    if family == "phi3":
        return tf.Phi3Config(**common, sliding_window=8)
    if family == "olmo2":
        return tf.Olmo2Config(**common)
    if family == "granite":
        return tf.GraniteConfig(**common, logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5,
                                attention_multiplier=0.2)
    if family == "cohere":
        return tf.CohereConfig(**common, logit_scale=4.0)
    if family == "phi":  # Phi-2: an output layer with a bias
        return tf.PhiConfig(**{k: v for k, v in common.items() if k != "num_key_value_heads"},
                            partial_rotary_factor=0.5)
    if family == "gpt_neox":
        return tf.GPTNeoXConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, max_position_embeddings=512, rotary_pct=0.5, **IDS)
    raise ValueError(family)


FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma2", "gemma3", "phi3", "olmo2", "granite",
            "cohere", "gpt_neox", "phi")


def make_family_model(family: str, vocab: int, seed: int = 0, dtype=torch.float32):
    """A tiny random causal LM of ``family``; weights scaled up so logits are not all near zero."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = _config(family, vocab)
    config.initializer_range = 0.2  # larger weights: logits of order 1-10, so soft-caps and scales matter
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    head = model.get_output_embeddings()
    if head.bias is not None:  # initialised to 0: make it count
        with torch.no_grad():
            head.bias.normal_(0, 1.0)
    model.config.use_cache = False
    return model.eval()
