"""Every common model family is sampled and trained as the function it computes (ground truth: the plain Hugging
Face forward of prompt + completion), with sequences longer than the sliding windows; LoRA finds every family's
linear layers and MoE experts."""

import copy

import pytest
import torch

from rlvr.core import LossSettings
from rlvr.learn.batch import StepBatch
from rlvr.learn.forward import completion_logprobs
from rlvr.learn.learner import Learner
from rlvr.learn.step import StepOptions, train_step
from rlvr.models.architecture import UnsupportedArchitecture, check_layers, output_layer
from rlvr.models.policy import LoraSpec, add_lora, trainable_parameters
from rlvr.rollout import SamplingParams, sample_groups
from tests.architectures import FAMILIES, make_family_model
from tests.reference import naive_update

SYSTEM = {"role": "system", "content": "Reply with only the number. system user assistant"}  # a shared prefix
PROMPTS = [[SYSTEM, {"role": "user", "content": "3 + 4 ="}],
           [SYSTEM, {"role": "user", "content": "12 * 9 = 108 and 7?"}]]
WINDOW = 8  # the sliding windows in tests/architectures.py; prompts are ~36 tokens, completions up to 16


def _hf_logprobs(model, groups) -> torch.Tensor:
    """[N, T] log-probs of each completion from one unpadded HF forward of its prompt + completion."""
    out = torch.zeros(groups.completion_ids.shape, dtype=torch.float64)
    for row in range(out.shape[0]):
        i = row // groups.group_size
        prompt = groups.prompt_ids[i][groups.prompt_mask[i].bool()]
        n = int(groups.completion_mask[row].sum())
        ids = torch.cat([prompt, groups.completion_ids[row, :n]])[None]
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + n].double()
        out[row, :n] = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1)
    return out


def _sample(model, tokenizer, params, group_size=4):
    model.generation_config.eos_token_id = 2
    with torch.no_grad():
        return sample_groups(model, tokenizer, PROMPTS, group_size, params, torch.Generator().manual_seed(0))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tokenizer):
    return request.param, make_family_model(request.param, len(tokenizer))


def test_sampler_and_trainer_compute_the_models_own_logprobs(family, tokenizer):
    _, model = family
    groups = _sample(model, tokenizer, SamplingParams(temperature=1.0, max_new_tokens=16))
    m = groups.completion_mask.bool()
    assert groups.prompt_ids.shape[1] + int(m.sum(-1).max()) > 2 * WINDOW
    with torch.no_grad():
        truth = _hf_logprobs(model, groups)
        batch = StepBatch.from_groups(groups, torch.zeros(groups.completion_ids.shape[0]))
        trainer, _ = completion_logprobs(model, batch, torch.arange(batch.num_completions), 16)
    assert (groups.behaviour_logp.double() - truth)[m].abs().max() < 1e-4
    assert (trainer.double() - groups.behaviour_logp.double())[m].abs().max() < 1e-4


def test_greedy_tokens_equal_generate(family, tokenizer):
    _, model = family
    groups = _sample(model, tokenizer, SamplingParams(temperature=0.0, max_new_tokens=12), group_size=1)
    for row in range(groups.completion_ids.shape[0]):
        prompt = groups.prompt_ids[row][groups.prompt_mask[row].bool()][None]
        ref = model.generate(input_ids=prompt, max_new_tokens=12, do_sample=False, eos_token_id=2, pad_token_id=0,
                             top_k=None, top_p=None)[0, prompt.shape[1]:]
        n = int(groups.completion_mask[row].sum())
        assert groups.completion_ids[row, :n].tolist() == ref[:n].tolist()


def _batch(model, tokenizer):
    groups = _sample(model, tokenizer, SamplingParams(temperature=1.0, max_new_tokens=10))
    adv = torch.linspace(-1.0, 1.0, groups.completion_ids.shape[0])
    return StepBatch.from_groups(groups, adv)


def test_full_finetuning_step_equals_the_naive_update(family, tokenizer):
    """The fused output layer (soft-cap, scale, bias) takes the gradient autograd takes through the model's own
    logits: one SGD step moves every weight as the naive full-logits update does."""
    _, base = family
    batch = _batch(base, tokenizer)
    settings = LossSettings(beta=0.0)
    model, naive = copy.deepcopy(base).float(), copy.deepcopy(base).float()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(Learner(model, opt), batch, settings,
               StepOptions(micro_batch_size=3, max_completion_tokens=10, max_grad_norm=0.0))
    naive_update(naive, batch, settings, lr=0.1, max_new_tokens=10)
    ours = torch.cat([(p - q).flatten() for p, q in zip(model.parameters(), base.parameters())])
    theirs = torch.cat([(p - q).flatten() for p, q in zip(naive.parameters(), base.parameters())])
    assert theirs.abs().max() > 1e-4  # the step moved the weights
    assert (ours - theirs).abs().max() <= 1e-3 * theirs.abs().max()


def test_lora_step_changes_the_adapters_of_every_linear_layer(family, tokenizer):
    name, base = family
    model = add_lora(copy.deepcopy(base), LoraSpec(r=4, alpha=8))
    batch = _batch(model, tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.Adam(trainable_parameters(model), lr=1e-2)
    train_step(Learner(model, opt), batch, LossSettings(beta=0.0),
               StepOptions(micro_batch_size=4, max_completion_tokens=10))
    moved = {n.split(".lora_")[0] for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n])}
    adapted = {n.split(".lora_")[0] for n in before}
    assert moved == adapted and adapted  # every adapter trained
    leaves = {n.rsplit(".", 1)[-1] for n in adapted}
    linear = {n.rsplit(".", 1)[-1] for n, mod in base.named_modules() if isinstance(mod, torch.nn.Linear)}
    assert leaves == (linear - {"lm_head", "embed_out"}) | ({"experts", "base_layer"} if name == "qwen3_moe" else set())
    if name == "qwen3_moe":  # routers stay frozen
        assert not any(p.requires_grad for n, p in model.named_parameters() if ".gate." in n)


def test_an_output_layer_rlvr_cannot_reproduce_is_refused(tokenizer):
    from transformers import LlamaForCausalLM

    class SquaredLogits(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits.square()
            return out

    model = SquaredLogits(make_family_model("llama", len(tokenizer)).config)
    with pytest.raises(UnsupportedArchitecture, match="not softcap"):
        output_layer(model)


def test_hybrid_layers_are_refused():
    from transformers import Qwen3NextConfig

    with pytest.raises(UnsupportedArchitecture, match="linear_attention"):
        check_layers(Qwen3NextConfig())


def test_fitted_output_layers(tokenizer):
    fitted = {f: output_layer(make_family_model(f, len(tokenizer))) for f in ("llama", "gemma2", "granite", "cohere")}
    assert (fitted["llama"].scale, fitted["llama"].softcap) == (1.0, None)
    assert fitted["gemma2"].softcap == pytest.approx(0.5, rel=1e-6)  # final_logit_softcapping
    assert fitted["granite"].scale == pytest.approx(1 / 4.0, rel=1e-6)  # logits_scaling divides
    assert fitted["cohere"].scale == pytest.approx(4.0, rel=1e-6)  # logit_scale multiplies
