"""Does compiling the decode step pay on this CPU? `torch.compile` of each decoder layer (dynamic shapes, rlvr's
preallocated cache, bf16-or-fp32 folded weights as `rollout.precision=auto` picks) against eager decoding.

    python benchmarks/decode_compile.py      # prints, and writes benchmarks/results/decode_compile.json

SmolLM2-135M-Instruct with a LoRA adapter, 4 prompts x G=8 x 32 tokens, temperature 1: two eager generations, then
the first compiled one (compile time included) and two more.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch

    from benchmarks.decoding import _prompts
    from benchmarks.machine import describe
    from rlvr.models.policy import LoraSpec, load_policy
    from rlvr.rollout import SamplingParams, encode_prompts, generate_groups
    from rlvr.rollout.decode_weights import decode_dtype, decoding
    from rlvr.rollout.groups import eos_token_ids

    torch.set_num_threads(os.cpu_count())
    model, tokenizer = load_policy("smollm2-135m-instruct", LoraSpec(r=16, alpha=32.0))
    model.eval()
    ids, mask = encode_prompts(tokenizer, _prompts(4))
    params = SamplingParams(temperature=1.0, max_new_tokens=32)
    eos, dtype = eos_token_ids(model, tokenizer), decode_dtype("auto", model)
    out = {"machine": describe(), "dtype": str(dtype).removeprefix("torch.")}
    with torch.no_grad(), decoding(model, dtype) as (backbone, head):
        def tokens_per_s(seed: int) -> tuple[float, float]:
            started = time.perf_counter()
            done = generate_groups(backbone, head, ids, mask, 8, params, eos, tokenizer.pad_token_id,
                                   torch.Generator().manual_seed(seed))
            wall = time.perf_counter() - started
            return float(done.mask.sum()) / wall, wall

        tokens_per_s(0)  # warm-up
        out["eager_tokens_per_s"] = [tokens_per_s(s)[0] for s in (1, 2)]
        for layer in backbone.layers:
            layer.forward = torch.compile(layer.forward, dynamic=True)
        out["first_compiled_s"] = tokens_per_s(0)[1]
        out["compiled_tokens_per_s"] = [tokens_per_s(s)[0] for s in (1, 2)]
    (ROOT / "benchmarks" / "results" / "decode_compile.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
