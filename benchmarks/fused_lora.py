"""A LoRA layer's forward and backward: peft's ``base(x) + B(A(x)) * scale`` against rlvr's fused layer, and a
whole decoder's LoRA training step (forward and backward of a micro-batch), alternated in one process.

    python benchmarks/fused_lora.py     # writes benchmarks/results/fused_lora.json + a BENCHMARKS.md section

Shapes: SmolLM2-135M's (hidden 576, MLP 1536), r = 16, a micro-batch of 32 sequences x 40 tokens.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOKENS, ROUNDS = 32 * 40, 7


def _layer(shape: tuple[int, int]):
    import torch
    from peft import LoraConfig, get_peft_model
    from torch import nn

    from rlvr.models.policy import frozen_linear

    class One(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(*shape, bias=False)

        def forward(self, x):
            return self.proj(x)

    model = get_peft_model(One(), LoraConfig(r=16, lora_alpha=32, target_modules=["proj"]))
    model.base_model.model.proj.base_layer.forward = lambda x, layer=model.base_model.model.proj.base_layer: \
        frozen_linear(layer, x)  # as rlvr's add_lora routes the frozen base product
    torch.nn.init.normal_(model.base_model.model.proj.lora_B["default"].weight, std=0.02)
    return model


def _seconds(fn, rounds: int) -> list[float]:
    fn()
    out = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def measure_layers() -> list[dict]:
    import torch

    from rlvr.models.fused_lora import fuse_lora_layers

    rows = []
    for shape in ((576, 576), (576, 1536), (1536, 576)):
        peft_model = _layer(shape)
        fused = copy.deepcopy(peft_model)
        fuse_lora_layers(fused)
        x = torch.randn(TOKENS, shape[0], requires_grad=True)

        def step(model, x=x):
            return lambda: model(x).sum().backward()

        times: dict[str, list[float]] = {"peft": [], "fused": []}
        for _ in range(3):  # alternated
            for name, model in (("peft", peft_model), ("fused", fused)):
                times[name] += _seconds(step(model), ROUNDS)
        peft_ms, fused_ms = (1e3 * statistics.median(times[k]) for k in ("peft", "fused"))
        rows.append({"shape": list(shape), "peft_ms": peft_ms, "fused_ms": fused_ms})
    return rows


def measure_decoder() -> dict:
    import torch
    from peft.tuners.lora.layer import Linear as LoraLinear

    from rlvr.models.policy import LoraSpec, add_lora, load_causal_lm, resolve_model_dir

    model = add_lora(load_causal_lm(resolve_model_dir("smollm2-135m-instruct")), LoraSpec())
    routed = [m for m in model.modules() if type(m) is LoraLinear and "forward" in vars(m)]
    ids = torch.randint(0, 49152, (32, 40))

    def step():
        model(input_ids=ids).logits[:, -1].sum().backward()

    times: dict[str, list[float]] = {"peft": [], "fused": []}
    for _ in range(2):
        for name in ("peft", "fused"):
            for m in routed:
                if name == "peft":
                    m._fused_forward = vars(m).pop("forward")
                elif "_fused_forward" in vars(m):
                    m.forward = vars(m).pop("_fused_forward")
            times[name] += _seconds(step, 3)
    return {k: statistics.median(v) for k, v in times.items()} | {"layers": len(routed)}


def main() -> None:
    import torch

    from benchmarks.machine import describe
    from benchmarks.report import publish

    torch.set_num_threads(torch.get_num_threads())
    layers, decoder = measure_layers(), measure_decoder()
    lines = [f"| {a} → {b} | {r['peft_ms']:.2f} | {r['fused_ms']:.2f} | **{r['fused_ms'] / r['peft_ms']:.2f}×** |"
             for r in layers for a, b in [r["shape"]]]
    md = f"""## Fused LoRA layers (`python benchmarks/fused_lora.py`)

Machine: {describe()}. Forward and backward of one LoRA layer (r = 16, fp32, {TOKENS} tokens; the frozen base
product routed as rlvr routes it), median of {3 * ROUNDS} alternated rounds; and SmolLM2-135M-Instruct with LoRA on
all {decoder['layers']} linear layers, forward and backward of 32 × 40 tokens (median of 6, alternated).

| layer (in → out) | peft (ms) | fused (ms) | fused ÷ peft |
|---|---|---|---|
{chr(10).join(lines)}
| SmolLM2-135M decoder, forward + backward | {1e3 * decoder['peft']:.0f} | {1e3 * decoder['fused']:.0f} \
| **{decoder['fused'] / decoder['peft']:.2f}×** |
"""
    publish("fused_lora", {"machine": describe(), "layers": layers, "decoder": decoder}, md)
    print(md)


if __name__ == "__main__":
    main()
