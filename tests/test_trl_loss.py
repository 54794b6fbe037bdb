"""TRL 1.16's own loss (GRPOTrainer._compute_loss) against rlvr's step on one fixed batch, for the objective
configurations a TRL script names: the same GRPOConfig fields go to trl.GRPOConfig and to rlvr.GRPOConfig, and the
loss and every weight's gradient are equal, or differ by exactly the departure docs/api.md states.

The batch: a tiny random Llama in float64, two prompts of unequal length (left-padded), eight completions of
unequal length, advantages with zeros and negatives, old log-probs far enough off that ratios clip, a reference
model with other weights, and two completions cut at max_completion_length. TRL is given the old log-probs as it
computes them for num_iterations > 1; rlvr reads them as the behaviour policy (ratio_to=behaviour, no importance
weight), the same slot of the same formula. Skipped when trl is not installed.
"""

import copy
import dataclasses

import pytest
import torch

from rlvr.api import GRPOConfig as RlvrConfig
from rlvr.api import _run_config
from rlvr.learn.batch import StepBatch
from rlvr.learn.learner import Learner
from rlvr.learn.step import StepOptions, train_step
from rlvr.models.policy import ReferencePolicy
from tests.conftest import make_model
from tests.reference import naive_logprobs

trl = pytest.importorskip("trl")
if not trl.__version__.startswith("1.16."):
    pytest.skip(f"the field table below is TRL 1.16's; trl {trl.__version__} is installed", allow_module_level=True)

T = 6  # max_completion_length
LENGTHS = [6, 4, 2, 5, 6, 3, 6, 1]  # completion lengths; rows 0 and 4 are cut at T (no EOS), row 6 ends at T
TRUNCATED = [True, False, False, False, True, False, False, False]
ADV = [0.9, -0.4, 0.0, -0.5, 1.2, 0.0, -0.7, 0.3]
GROUP = 4

# (TRL fields, what rlvr computes): "equal", or the departure docs/api.md states (the test checks it too)
CASES = [
    *[({"loss_type": lt}, "equal") for lt in ("grpo", "dapo", "dr_grpo", "bnpo", "sapo", "luspo")],
    ({"loss_type": "cispo", "epsilon_high": 5.0}, "equal"),
    ({"loss_type": "cispo", "epsilon_high": 1.3}, "equal"),
    ({"loss_type": "cispo", "epsilon_high": 5.0, "beta": 0.04}, "equal"),
    *[({"loss_type": lt, "importance_sampling_level": "sequence"}, "equal") for lt in ("grpo", "dapo", "luspo")],
    *[({"loss_type": lt, "beta": 0.04}, "equal") for lt in ("grpo", "dapo", "dr_grpo", "sapo")],
    ({"loss_type": "grpo", "beta": 0.04, "importance_sampling_level": "sequence"}, "equal"),
    *[({"loss_type": lt, "beta": 0.04, "use_bias_correction_kl": False}, "equal") for lt in ("grpo", "dapo")],
    ({"loss_type": "dapo", "epsilon": 0.1, "epsilon_high": 0.28}, "equal"),
    ({"loss_type": "dapo", "epsilon_high": 0.28, "delta": 1.5}, "equal"),
    ({"loss_type": "sapo", "sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0}, "equal"),
    *[({"loss_type": lt, "entropy_coef": 0.1}, "equal") for lt in ("grpo", "dapo", "dr_grpo")],
    ({"loss_type": "dapo", "entropy_coef": 0.1, "beta": 0.04}, "equal"),
    ({"loss_type": "dapo", "top_entropy_quantile": 0.5}, "equal"),
    ({"loss_type": "grpo", "top_entropy_quantile": 0.5, "beta": 0.04}, "equal"),
    *[({"loss_type": lt, "gradient_accumulation_steps": 2}, "equal") for lt in ("grpo", "dapo", "dr_grpo")],
    ({"loss_type": "cispo", "epsilon_high": 5.0, "gradient_accumulation_steps": 2}, "equal"),
    ({"loss_type": "dapo", "beta": 0.04, "gradient_accumulation_steps": 2}, "equal"),
    *[({"loss_type": lt, "mask_truncated_completions": True}, "equal") for lt in ("dapo", "bnpo")],
    ({"loss_type": "cispo", "epsilon_high": 5.0, "mask_truncated_completions": True}, "equal"),
    *[({"loss_type": lt, "mask_truncated_completions": True}, "rows") for lt in ("grpo", "dr_grpo", "sapo", "luspo")],
    ({"loss_type": "grpo", "mask_truncated_completions": True, "beta": 0.04}, "rows"),
    ({"loss_type": "dapo", "entropy_coef": 0.1, "gradient_accumulation_steps": 2}, "entropy_accumulation"),
    ({"loss_type": "dapo", "entropy_coef": 0.1, "top_entropy_quantile": 0.5}, "entropy_selected"),
]


def _case_id(case) -> str:
    fields, _ = case
    return "-".join(f"{k}={v}" for k, v in fields.items())


@pytest.fixture(scope="module")
def fixed(tokenizer, tmp_path_factory):
    """The models (policy saved to a directory TRL loads, reference) and the fixed batch as rlvr's StepBatch."""
    policy = make_model(len(tokenizer), seed=0).double()
    reference = make_model(len(tokenizer), seed=1).double()
    model_dir = tmp_path_factory.mktemp("trl-loss-model")
    policy.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    g = torch.Generator().manual_seed(0)
    prompt_lengths = [3, 5]
    prompt_ids = torch.randint(3, len(tokenizer), (2, 5), generator=g)
    prompt_mask = (torch.arange(5)[None] >= 5 - torch.tensor(prompt_lengths)[:, None]).long()  # left-padded
    prompt_ids = prompt_ids * prompt_mask
    completion_mask = (torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]).long()
    completion_ids = torch.randint(3, len(tokenizer), (8, T), generator=g) * completion_mask
    batch = StepBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                      completion_mask=completion_mask, loss_mask=completion_mask.clone(),
                      behaviour_logp=torch.zeros(8, T, dtype=torch.float64),
                      temperature=torch.ones(8, T, dtype=torch.float64),
                      adv=torch.tensor(ADV, dtype=torch.float64), group_size=GROUP)
    with torch.no_grad():
        current = naive_logprobs(policy, batch)
        batch.behaviour_logp = (current + 0.3 * torch.randn(current.shape, generator=g, dtype=torch.float64))
        batch.behaviour_logp *= completion_mask
        ref_logp = naive_logprobs(reference, batch)
    return {"dir": model_dir, "policy": policy, "reference": reference, "batch": batch, "ref_logp": ref_logp}


def _trl_loss(fields: dict, fixed, tokenizer, tmp_path) -> tuple[float, dict[str, torch.Tensor]]:
    """TRL's loss over the batch (its gradient_accumulation_steps micro-batches, rows in order) and the summed
    gradients, from GRPOTrainer._compute_loss of a trainer built on the saved policy."""
    from datasets import Dataset

    accumulation = fields.get("gradient_accumulation_steps", 1)
    # bf16=False: TRL's default autocasts even on a CPU (rlvr's GRPOConfig maps bf16 to model.autocast as well)
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to="none", num_generations=GROUP,
                          per_device_train_batch_size=8 // accumulation, max_completion_length=T, bf16=False,
                          model_init_kwargs={"dtype": torch.float64}, gradient_checkpointing=False, **fields)
    trainer = trl.GRPOTrainer(model=str(fixed["dir"]), args=args,
                              reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                              train_dataset=Dataset.from_list([{"prompt": "1 + 1"}] * 8), processing_class=tokenizer)
    model = trainer.model.train()
    assert next(model.parameters()).dtype == torch.float64
    trainer.current_gradient_accumulation_steps = accumulation
    b = fixed["batch"]
    mask = b.completion_mask
    if fields.get("mask_truncated_completions"):
        mask = mask * ~torch.tensor(TRUNCATED)[:, None]  # what TRL's generation step does to the mask
    inputs = {"prompt_ids": b.prompt_ids.repeat_interleave(GROUP, 0),
              "prompt_mask": b.prompt_mask.repeat_interleave(GROUP, 0), "completion_ids": b.completion_ids,
              "completion_mask": mask, "advantages": b.adv.clone(), "old_per_token_logps": b.behaviour_logp,
              "ref_per_token_logps": fixed["ref_logp"], "num_items_in_batch": mask.sum()}
    total = 0.0
    rows = 8 // accumulation
    for start in range(0, 8, rows):
        part = {k: (v[start:start + rows] if k != "num_items_in_batch" else v) for k, v in inputs.items()}
        loss = trainer._compute_loss(model, part)
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def _rlvr_loss(fields: dict, fixed, tmp_path, **knobs) -> tuple[float, dict[str, torch.Tensor]]:
    """rlvr's step on the same batch, with the LossSettings rlvr.GRPOConfig(**fields) maps to (and ``knobs``, algo
    keys a YAML config can set); lr 0, so the gradients stay in .grad."""
    accumulation = fields.get("gradient_accumulation_steps", 1)
    args = RlvrConfig(output_dir=str(tmp_path / "rlvr"), num_generations=GROUP, max_completion_length=T,
                      per_device_train_batch_size=8 // accumulation, **fields)
    cfg = _run_config(args, "tiny", None, 8, "train.jsonl", "eval.jsonl", 8, "math_correct",
                      [("math_correct", {}, 1.0)], {})
    settings = dataclasses.replace(cfg.algo.loss_settings(), ratio_to="behaviour", is_level="none", **knobs)
    b = copy.copy(fixed["batch"])
    if cfg.algo.mask_truncated:
        b.loss_mask = b.completion_mask * ~torch.tensor(TRUNCATED)[:, None]
    model = copy.deepcopy(fixed["policy"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = train_step(Learner(model, optimizer, None, ReferencePolicy(fixed["reference"])), b, settings,
                         StepOptions(max_completion_tokens=cfg.rollout.max_new_tokens, micro_batch_size=3,
                                     max_grad_norm=0.0, chunk_tokens=5))
    return metrics["loss"], {n: p.grad.clone() for n, p in model.named_parameters()}


def _close(a: float, b: float, ga: dict, gb: dict) -> bool:
    """Loss within 1e-5 relative, every gradient within 1e-4 of its tensor's largest entry."""
    return abs(a - b) <= 1e-5 * max(abs(a), abs(b), 1e-8) and all(
        torch.allclose(ga[n], gb[n], rtol=0, atol=1e-4 * float(ga[n].abs().max()) + 1e-12) for n in ga)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_rlvr_loss_equals_trls_or_differs_as_documented(case, fixed, tokenizer, tmp_path):
    fields, status = case
    trl_loss, trl_grads = _trl_loss(fields, fixed, tokenizer, tmp_path)
    loss, grads = _rlvr_loss(fields, fixed, tmp_path)
    assert set(grads) == set(trl_grads)
    if status == "equal":
        assert _close(loss, trl_loss, grads, trl_grads), (loss, trl_loss)
        return
    assert not _close(loss, trl_loss, grads, trl_grads)  # a departure: the row below says what rlvr computes
    if status == "rows":  # TRL divides by every row; rlvr by the rows with a trained token, or every row on request
        every_row, every_row_grads = _rlvr_loss(fields, fixed, tmp_path, count_untrained_rows=True)
        assert _close(every_row, trl_loss, every_row_grads, trl_grads)
    elif status == "entropy_accumulation":  # rlvr's bonus is one mean over the step: TRL's without accumulation
        whole, whole_grads = _trl_loss({**fields, "gradient_accumulation_steps": 1}, fixed, tokenizer, tmp_path)
        assert _close(loss, whole, grads, whole_grads)
    elif status == "entropy_selected":  # rlvr's bonus is the mean entropy of every trained token, TRL's of those
        # selected: rlvr's loss is TRL's policy term minus the coefficient times the mean over every trained token
        policy_only, _ = _trl_loss({**fields, "entropy_coef": 0.0}, fixed, tokenizer, tmp_path)
        b = fixed["batch"]
        with torch.no_grad():
            entropy = naive_logprobs(fixed["policy"], b, with_entropy=True)[1]
        mean_entropy = float((entropy * b.completion_mask).sum() / b.completion_mask.sum())
        assert loss == pytest.approx(policy_only - fields["entropy_coef"] * mean_entropy, rel=1e-5)
    else:
        raise AssertionError(f"unknown status {status!r}")
