"""Peak training memory, PPO vs GRPO, measured side by side, broken down by component, against `rlvr plan`.

    python benchmarks/memory.py [--steps 2]     # writes benchmarks/results/memory.json + a BENCHMARKS.md section

Same model (SmolLM2-135M-Instruct, fp32), same batch (4 prompts x G=8, word problems of different lengths
from examples/data, 64 completion tokens each),
micro-batches of 16 completions, AdamW, one process per configuration, one after
the other:
  PPO full · GRPO full beta>0 · GRPO full beta=0 · PPO LoRA · GRPO LoRA   - the plain step (TRL's way: every
      completion carries its prompt; logits of the completion positions, log-softmax kept for backward)
  GRPO LoRA, lean step · PPO LoRA, lean step                                - rlvr's step (prompt once per
      group, fused output layer), rlvr's PPO
Peak: the process's resident set during the training steps (Linux VmHWM, reset just before them) minus what it
held before the model loaded; on CUDA, torch.cuda.max_memory_allocated. Breakdown, by tensor accounting:
weights, reference and critic parameters (bytes of the tensors), gradients (after backward), optimizer states
(after the step), activations and logits (every tensor autograd saves for backward during one micro-batch's
forward, parameters excluded; logits = the ones with a vocabulary-sized dimension). What the breakdown misses
(transient buffers in backward, allocator slack) is the residual. Generation is not part of the step measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

B, G, T, MICRO = 4, 8, 64, 16
HEAP_THRESHOLD_KB = 256  # train.heap_threshold_kb for the leanest peak (platform/memory.py; the default 0 keeps it)
CONFIGS = {  # name: (algo, lora, beta or PPO's kl_coef, lean step)
    "PPO full": ("ppo", False, 0.05, False),
    "GRPO full β>0": ("grpo", False, 0.04, False),
    "GRPO full β=0": ("grpo", False, 0.0, False),
    "PPO LoRA": ("ppo", True, 0.05, False),
    "GRPO LoRA": ("grpo", True, 0.04, False),
    "GRPO LoRA, lean step": ("grpo", True, 0.04, True),
    "PPO LoRA, lean step": ("ppo", True, 0.05, True),
}


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _nbytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


class SavedTensors:
    """Bytes of the tensors autograd saves for backward (parameters excluded), split by vocabulary dimension."""

    def __init__(self, params, vocab: int):
        import torch

        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.vocab, self.storages, self.logits = vocab, {}, set()
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        key = t.untyped_storage().data_ptr()
        if key not in self.params:
            self.storages[key] = max(self.storages.get(key, 0), t.untyped_storage().nbytes())
            if self.vocab in t.shape:
                self.logits.add(key)
        return t

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def split(self) -> tuple[int, int]:
        logits = sum(v for k, v in self.storages.items() if k in self.logits)
        return sum(self.storages.values()) - logits, logits


# ------------------------------------------------------------------------------------------ the plain step
def _plain_logprobs(model, batch, rows, temperature=1.0):
    """TRL's way: prompt + completion for each completion, logits of the completion positions only,
    log-softmax row by row (kept for backward)."""
    import torch

    g = batch.group_size
    ids = torch.cat([batch.prompt_ids[rows // g], batch.completion_ids[rows]], 1)
    mask = torch.cat([batch.prompt_mask[rows // g], batch.completion_mask[rows]], 1)
    t = batch.completion_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                   logits_to_keep=t + 1).logits[:, :-1] / temperature
    out = [torch.log_softmax(row, -1).gather(-1, y[:, None]).squeeze(-1)
           for row, y in zip(logits, batch.completion_ids[rows])]
    return torch.stack(out)


def _plain_values(critic, batch, rows):
    import torch

    g = batch.group_size
    ids = torch.cat([batch.prompt_ids[rows // g], batch.completion_ids[rows]], 1)
    mask = torch.cat([batch.prompt_mask[rows // g], batch.completion_mask[rows]], 1)
    t = batch.completion_ids.shape[1]
    from rlvr.models.policy import backbone_and_head

    with critic._body() as body:
        hidden = backbone_and_head(body)[0](input_ids=ids, attention_mask=mask).last_hidden_state
    return critic.head(hidden[:, -t - 1 : -1]).squeeze(-1)


def _plain_step(model, critic, reference, optimizer, batch, rewards, settings, ppo, measure=None):
    """One optimizer step of the plain implementation (GRPO, or PPO with the critic)."""
    import torch

    from rlvr.core import TokenBatch, loss_normaliser, policy_loss
    from rlvr.core.ppo import gae, token_rewards, value_loss, whiten

    mask = batch.loss_mask
    micro = list(torch.arange(batch.num_completions).split(MICRO))
    ref_logp = None
    if reference is not None:
        with torch.no_grad(), reference.active() as ref_model:
            ref_logp = torch.cat([_plain_logprobs(ref_model, batch, r) for r in micro])
    adv = batch.adv[:, None].expand_as(batch.behaviour_logp)
    if critic is not None:
        with torch.no_grad():
            old_values = torch.cat([_plain_values(critic, batch, r) for r in micro])
        kl = (batch.behaviour_logp - ref_logp) * mask if ref_logp is not None else None
        r = token_rewards(rewards, mask, kl, ppo.kl_coef)
        adv, returns = gae(r, old_values, mask, ppo.gamma, ppo.lam)
        adv = whiten(adv, mask)
    norm = loss_normaliser(mask, settings.aggregation, T)
    optimizer.zero_grad(set_to_none=True)
    for i, rows in enumerate(micro):
        ctx = measure[0] if (measure and i == len(micro) - 1) else None
        with ctx or _null():
            logp = _plain_logprobs(model, batch, rows)
        x = TokenBatch(logp=logp, behaviour_logp=batch.behaviour_logp[rows], adv=adv[rows],
                       mask=mask[rows].to(logp.dtype),
                       ref_logp=None if (ref_logp is None or critic is not None) else ref_logp[rows])
        loss, _ = policy_loss(x, settings if critic is None else _no_kl(settings), norm, float(mask.sum()))
        loss.backward()
        if critic is not None:
            ctx = measure[1] if (measure and i == len(micro) - 1) else None
            with ctx or _null():
                values = _plain_values(critic, batch, rows)
            v = (value_loss(values, old_values[rows], returns[rows], ppo.value_clip) * mask[rows]).sum()
            (ppo.vf_coef * v / mask.sum()).backward()
    return optimizer


def _no_kl(settings):
    from dataclasses import replace

    return replace(settings, beta=0.0)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ------------------------------------------------------------------------------------------ one configuration
def child(name: str, steps: int) -> dict:
    import torch

    from rlvr.platform.memory import return_freed_memory

    torch.set_num_threads(os.cpu_count())
    return_freed_memory(HEAP_THRESHOLD_KB << 10)
    from rlvr.core import LossSettings
    from rlvr.core.ppo import PPOSettings
    from rlvr.learn.batch import StepBatch
    from rlvr.learn.learner import Learner
    from rlvr.learn.ppo import Critic, ppo_step
    from rlvr.learn.step import StepOptions, train_step
    from rlvr.models.policy import LoraSpec, ReferencePolicy, load_policy

    algo, lora, kl, lean = CONFIGS[name]
    base_kb = _rss_kb("VmRSS")
    model, tokenizer = load_policy("smollm2-135m-instruct", LoraSpec(r=16, alpha=32.0) if lora else None)
    reference = ReferencePolicy(model) if kl else None
    critic = Critic(model) if algo == "ppo" else None
    params = critic.trainable_parameters(model) if critic else [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    settings = LossSettings(beta=0.0 if algo == "ppo" else kl, aggregation="token_mean")
    ppo = PPOSettings(kl_coef=kl)

    from rlvr.models.prompts import encode_prompts
    from rlvr.rollout import Groups

    prompt_ids, prompt_mask = encode_prompts(tokenizer, _prompts())
    gen = torch.Generator().manual_seed(0)
    n = B * G
    groups = Groups(prompt_ids, prompt_mask, torch.randint(0, 49152, (n, T), generator=gen),
                    torch.ones(n, T, dtype=torch.long), -torch.rand(n, T, generator=gen) * 3,
                    torch.ones(n, dtype=torch.bool), [""] * n, G, torch.zeros(n, dtype=torch.long), torch.ones(n))
    rewards = (torch.rand(n, generator=gen) > 0.5).float()
    batch = StepBatch.from_groups(groups, rewards - rewards.view(B, G).mean(-1).repeat_interleave(G))

    def step(measure=None):
        if lean and critic is None:
            return train_step(Learner(model, optimizer, None, reference), batch, settings,
                              StepOptions(micro_batch_size=MICRO, max_completion_tokens=T))
        if lean:
            return ppo_step(Learner(model, optimizer, None, reference), critic, batch, rewards, settings, ppo,
                            StepOptions(max_completion_tokens=T, micro_batch_size=MICRO))
        _plain_step(model, critic, reference, optimizer, batch, rewards, settings, ppo, measure)
        optimizer.step()

    all_params = list(model.parameters()) + (list(critic.parameters()) if critic else [])
    policy_weights = _nbytes(model.parameters())
    ref_weights = _nbytes(reference._copy.parameters()) if reference is not None and reference._copy else 0
    critic_weights = _nbytes(critic.parameters()) if critic is not None else 0
    if critic is not None and critic.body is None:  # the LoRA critic's adapter lives in the policy model
        adapter = [p for n_, p in model.named_parameters() if ".critic." in n_]
        critic_weights += _nbytes(adapter)
        policy_weights -= _nbytes(adapter)

    # warm-up step (Adam states appear at the first step), then the measured steps
    step()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident set (VmHWM)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    peak_kb = _rss_kb("VmHWM")

    # the breakdown (the critic's gradients and optimizer states count with the critic)
    critic_ids = {id(p) for p in critic.parameters_to_train()} if critic is not None else set()

    def grads_and_states(ps):
        grads = [p.grad for p in ps if p.grad is not None]
        states = [t for p in ps for t in optimizer.state.get(p, {}).values() if torch.is_tensor(t) and t.dim() > 0]
        return _nbytes(grads), _nbytes(states)

    policy_grads, policy_opt = grads_and_states([p for p in params if id(p) not in critic_ids])
    critic_grads, critic_opt = grads_and_states([p for p in params if id(p) in critic_ids])
    saved_policy = SavedTensors(all_params, 49152)
    saved_critic = SavedTensors(all_params, 49152)
    if lean:  # one micro-batch through the same code the step runs
        from rlvr.core import loss_normaliser, policy_loss
        from rlvr.learn.step import FrozenLogprobs, micro_batch_inputs

        rows_ = torch.arange(MICRO)
        no_kl = _no_kl(settings)  # the KL term changes no activation
        with saved_policy:
            x = micro_batch_inputs(model, batch, rows_, FrozenLogprobs())
            loss, _ = policy_loss(x, no_kl, loss_normaliser(batch.loss_mask, "token_mean", T),
                                  float(batch.loss_mask.sum()))
        del loss
        if critic is not None:
            with saved_critic:
                v = critic.values(batch, rows_)
            del v
    else:
        _plain_step(model, critic, reference, optimizer, batch, rewards, settings, ppo, (saved_policy, saved_critic))
    act_p, logits_p = saved_policy.split
    act_c, _ = saved_critic.split
    result = {
        "name": name, "peak_mb": (peak_kb - base_kb) / 1024, "step_s": statistics.median(times),
        "weights_mb": policy_weights / 2**20, "reference_mb": ref_weights / 2**20,
        "critic_mb": (critic_weights + critic_grads + critic_opt) / 2**20,
        "gradients_mb": policy_grads / 2**20, "optimizer_mb": policy_opt / 2**20,
        "activations_mb": max(act_p, act_c) / 2**20, "logits_mb": logits_p / 2**20,
    }
    if torch.cuda.is_available():
        result["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return result


def _planned(name: str) -> dict:
    from rlvr.config.plan import ARCHS, PlannedRun, plan

    algo, lora, kl, lean = CONFIGS[name]
    run = PlannedRun(algo=algo, dtype="fp32", lora_rank=16 if lora else 0, beta=kl, prompts=B, group=G,
                     prompt_len=_prompt_len(), completion_len=T, micro_batch=MICRO, lean=lean, checkpointing=False)
    return plan(ARCHS["smollm2-135m"], run)


def _prompts() -> list:
    """Word problems of different lengths (so attention has a padding mask, as real RL batches do)."""
    from rlvr.tasks import load_jsonl

    rows = load_jsonl(ROOT / "examples" / "data" / "word_problems_train.jsonl", ("answer",))
    by_length = sorted(rows, key=lambda r: len(r["prompt"][-1]["content"]))
    return [by_length[i * (len(by_length) - 1) // (B - 1)]["prompt"] for i in range(B)]


def _prompt_len() -> int:
    from rlvr.models.policy import load_tokenizer, resolve_model_dir
    from rlvr.models.prompts import encode_prompts

    tok = load_tokenizer(resolve_model_dir("smollm2-135m-instruct"))
    return int(encode_prompts(tok, _prompts())[0].shape[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return
    from benchmarks.machine import describe
    from benchmarks.report import publish

    results = {"machine": describe(), "batch": {"B": B, "G": G, "T": T, "micro": MICRO, "P": _prompt_len()},
               "runs": {}}
    for name in CONFIGS:
        print(f"running {name} ...", flush=True)
        done = subprocess.run([sys.executable, __file__, "--child", name, "--steps", str(args.steps)], cwd=ROOT,
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        planned = {k: v / 2**20 for k, v in _planned(name).items()}
        results["runs"][name] = {"measured": measured, "planned_mb": planned}
    results["heap_threshold_kb"] = HEAP_THRESHOLD_KB
    publish("memory", results, _markdown(results))


def _markdown(r: dict) -> str:
    names = list(r["runs"])
    comps = [("weights", "weights_mb"), ("reference", "reference_mb"), ("critic (all of it)", "critic_mb"),
             ("gradients", "gradients_mb"), ("optimizer states", "optimizer_mb"), ("activations", "activations_mb"),
             ("logits", "logits_mb")]
    lines = ["| MB | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, key in comps:
        lines.append(f"| {label} | " + " | ".join(f"{r['runs'][n]['measured'][key]:.0f}" for n in names) + " |")
    lines.append("| **measured peak** | " + " | ".join(f"**{r['runs'][n]['measured']['peak_mb']:.0f}**"
                                                     for n in names) + " |")
    lines.append("| residual (transients, allocator) | " + " | ".join(
        f"{r['runs'][n]['measured']['peak_mb'] - sum(r['runs'][n]['measured'][k] for _, k in comps):.0f}"
        for n in names) + " |")
    lines.append("| `rlvr plan` | " + " | ".join(f"{r['runs'][n]['planned_mb']['total']:.0f}" for n in names) + " |")
    lines.append("| planner error | " + " | ".join(
        f"{100 * (r['runs'][n]['planned_mb']['total'] / r['runs'][n]['measured']['peak_mb'] - 1):+.0f} %"
        for n in names) + " |")
    lines.append("| step time (s) | " + " | ".join(f"{r['runs'][n]['measured']['step_s']:.1f}" for n in names) + " |")
    peak = {n: r["runs"][n]["measured"]["peak_mb"] for n in names}
    saving = [("full fine-tuning, β>0", "PPO full", "GRPO full β>0"), ("full, GRPO β=0", "PPO full", "GRPO full β=0"),
              ("LoRA", "PPO LoRA", "GRPO LoRA"), ("LoRA, lean step", "PPO LoRA, lean step", "GRPO LoRA, lean step")]
    savings = "; ".join(f"{label}: {100 * (1 - peak[g] / peak[p]):.0f} %" for label, p, g in saving)
    b = r["batch"]
    return f"""## Memory: PPO vs GRPO, measured (`python benchmarks/memory.py`)

Machine: {r['machine']}. SmolLM2-135M-Instruct fp32, {b['B']} prompts × G={b['G']}, prompts of {b['P']} tokens, \\
{b['T']} completion tokens, micro-batches of {b['micro']}, AdamW; one process per configuration. Peak = resident set \\
during the step minus before the model loaded; breakdown by tensor accounting (module docstring). glibc mmap \\
threshold {r.get('heap_threshold_kb', 256)} KiB (`train.heap_threshold_kb`; at 512 KiB the lean \\
step keeps ~170 MB more freed heap, measured apart: rlvr/platform/memory.py). Step times: one step each, shared VM.

{chr(10).join(lines)}

GRPO's saving over PPO (measured peak): {savings}.
"""


if __name__ == "__main__":
    main()
