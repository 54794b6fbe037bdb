"""Peak memory of one training micro-batch on Gemma 3 270M (262,144-token vocabulary): rlvr's fused output layer
against the naive logits path.

    python benchmarks/vocab_memory.py [--threads 1]   # writes benchmarks/results/vocab_memory.json and .md

Same model (gemma3-270m, fp32, LoRA r=16 on every linear layer of the body, seeded; the tied output layer is
frozen), same tokens (2 prompts x G=4 = 8 completions x 64 tokens, random completion ids, every token trained,
behaviour log-probs the model's own), same body pass (rlvr's, prompt run once per group), same clipped-surrogate
loss (token mean); one loss + backward:
  naive: logits [M, V] for the M completion tokens, log_softmax, gather, loss, backward (autograd keeps the
         log-softmax output for backward and builds a [M, V] gradient);
  fused: rlvr.core.fused (rlvr.learn.step.micro_batch_inputs) at train.logprob_chunk 512 (the default), 128, 32:
         logits exist one [chunk, V] block at a time, gradients taken in the forward pass.
Peak: the resident set's high-water mark (Linux VmHWM, reset just before the pass) minus the resident set just
before it, in a fresh process per variant (model loaded, behaviour log-probs taken); glibc's mmap threshold pinned at
256 KiB (platform/memory.py) so freed blocks leave the resident set. The loss and the LoRA gradient norm are printed
for each variant: equal up to float rounding, as the paths compute the same thing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "gemma3-270m"
B, G, T = 2, 4, 64
VARIANTS = {  # name: chunk tokens of the fused path (0: the naive path)
    "naive: logits [M, V]": 0,
    "fused, chunk 512 (default)": 512,
    "fused, chunk 128": 128,
    "fused, chunk 32": 32,
}
PROMPTS = ["Q: 3 + 4 =\nA: 7\n\nQ: 6 * 2 =\nA: 12\n\nQ: 9 * 5 =\nA:", "Q: 8 + 6 =\nA:"]


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _batch(model, tokenizer, vocab: int):
    """8 completions of random tokens, behaviour log-probs the model's own (so every ratio starts at 1)."""
    import torch

    from rlvr.learn.batch import StepBatch
    from rlvr.learn.forward import completion_logprobs
    from rlvr.models.prompts import encode_prompts
    from rlvr.rollout import Groups

    prompt_ids, prompt_mask = encode_prompts(tokenizer, PROMPTS)
    gen = torch.Generator().manual_seed(0)
    n = B * G
    groups = Groups(prompt_ids, prompt_mask, torch.randint(3, vocab, (n, T), generator=gen),
                    torch.ones(n, T, dtype=torch.long), -torch.rand(n, T, generator=gen) * 3,
                    torch.zeros(n, dtype=torch.bool), [""] * n, G, torch.zeros(n, dtype=torch.long), torch.ones(n))
    adv = torch.tensor([1.0, -0.5] * (n // 2))  # [N]
    batch = StepBatch.from_groups(groups, adv)
    with torch.no_grad():
        batch.behaviour_logp = completion_logprobs(model, batch, torch.arange(n))[0].float()
    return batch


def _naive_loss(model, batch, rows, settings, normaliser):
    """The textbook path: every completion token's logits at once, kept by autograd for backward."""
    import torch

    from rlvr.core import TokenBatch, policy_loss
    from rlvr.learn.forward import completion_hidden
    from rlvr.models.policy import backbone_and_head

    hidden = completion_hidden(model, batch, rows, share_prompt=True)  # [n, T, H]
    logits = backbone_and_head(model)[1](hidden)  # [n, T, V]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, batch.completion_ids[rows, :, None]).squeeze(-1)
    mask = batch.loss_mask[rows].to(logp.dtype)
    x = TokenBatch(logp=logp, behaviour_logp=batch.behaviour_logp[rows], adv=batch.token_adv(rows), mask=mask)
    return policy_loss(x, settings, normaliser, float(mask.sum()))[0]


def child(name: str, threads: int) -> dict:
    import torch

    from rlvr.core import LossSettings, loss_normaliser, policy_loss
    from rlvr.learn.step import FrozenLogprobs, micro_batch_inputs
    from rlvr.models.policy import LoraSpec, load_policy
    from rlvr.platform.memory import return_freed_memory

    torch.set_num_threads(threads or os.cpu_count())
    return_freed_memory(256 << 10)
    torch.manual_seed(0)  # the LoRA initialisation: the same in every variant's process
    model, tokenizer = load_policy(MODEL, LoraSpec(r=16, alpha=32.0))
    vocab = model.config.vocab_size
    batch = _batch(model, tokenizer, vocab)
    rows = torch.arange(batch.num_completions)
    settings = LossSettings(beta=0.0, aggregation="token_mean")
    normaliser = loss_normaliser(batch.loss_mask, "token_mean", T)
    chunk = VARIANTS[name]
    base_kb = _rss_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark (VmHWM)
    started = time.perf_counter()
    if chunk:
        x = micro_batch_inputs(model, batch, rows, FrozenLogprobs(), chunk_tokens=chunk)
        loss = policy_loss(x, settings, normaliser, float(batch.loss_mask.sum()))[0]
    else:
        loss = _naive_loss(model, batch, rows, settings, normaliser)
    loss.backward()
    seconds = time.perf_counter() - started
    peak_kb = _rss_kb("VmHWM")
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    m = int(batch.loss_mask.sum())
    return {"name": name, "chunk": chunk, "tokens": m, "vocab": vocab, "peak_mb": (peak_kb - base_kb) / 1024,
            "logits_mb": m * vocab * 4 / 2**20, "seconds": seconds, "loss": float(loss),
            "lora_grad_norm": float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores; 1 on a busy machine)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.threads)))
        return
    from benchmarks.machine import describe

    threads = args.threads or os.cpu_count()
    results = {"machine": describe(), "threads": threads, "model": MODEL, "batch": {"B": B, "G": G, "T": T}, "runs": {}}
    for name in VARIANTS:
        print(f"running {name} ...", flush=True)
        done = subprocess.run([sys.executable, __file__, "--child", name, "--threads", str(threads)], cwd=ROOT,
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
        results["runs"][name] = json.loads(done.stdout.strip().splitlines()[-1])
    out = ROOT / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "vocab_memory.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "vocab_memory.md").write_text(_markdown(results))
    print(_markdown(results))


def _markdown(r: dict) -> str:
    runs = list(r["runs"].values())
    naive = runs[0]["peak_mb"]
    lines = ["| path | peak above the loaded model (MB) | vs naive | loss | LoRA grad norm |", "|---|---|---|---|---|"]
    for x in runs:
        lines.append(f"| {x['name']} | {x['peak_mb']:.0f} | {x['peak_mb'] / naive:.2f}x | {x['loss']:.6f} | "
                     f"{x['lora_grad_norm']:.6f} |")
    x = runs[0]
    return f"""## Memory: a 262k-token vocabulary, fused output layer vs naive logits

`python benchmarks/vocab_memory.py`.

Machine: {r['machine']}; torch threads in each variant: {r['threads']}. {r['model']} fp32 + LoRA r=16, one \
micro-batch of {x['tokens']} completion tokens ({r['batch']['B']} prompts x G={r['batch']['G']} x {r['batch']['T']} \
tokens), loss + backward; one fresh process per variant; peak = resident-set high-water mark during the pass minus \
the resident set before it. One logits tensor [M, V] in fp32 is {x['logits_mb']:.0f} MB.

{chr(10).join(lines)}
"""


if __name__ == "__main__":
    main()
