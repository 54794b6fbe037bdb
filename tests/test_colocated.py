"""The colocated vLLM backend's parts that need no vLLM: the engine's arguments, the learner's weights under their
checkpoint names, the config. The engine itself is tested in tests/integration/test_vllm_colocated.py (make
test-vllm, in the venv that has vLLM's CPU build)."""

import copy

import pytest
import torch

from rlvr.config.loading import ConfigError, load_config
from rlvr.models.policy import LoraSpec, add_lora
from rlvr.rollout.colocated import EngineSettings, base_weights, engine_kwargs, max_lora_rank
from tests.conftest import make_model


def test_a_peft_model_pushes_its_base_weights_under_the_checkpoint_s_names(tokenizer):
    """What reload_weights receives from a LoRA learner is the plain model's parameters, name for name and value
    for value (no lora_A/B, no base_layer in a name), whatever the adapter holds."""
    plain = make_model(len(tokenizer))
    wrapped = add_lora(copy.deepcopy(plain), LoraSpec(r=4))
    for name, p in wrapped.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    want = dict(plain.named_parameters())
    got = dict(base_weights(wrapped))
    assert set(got) == set(want) and len(got) == len(list(plain.parameters()))
    for name, t in got.items():
        assert torch.equal(t, want[name]) and not t.requires_grad
    assert set(dict(base_weights(plain))) == set(want)


def test_the_engine_is_built_with_the_learner_s_dtype_rank_and_sleep_where_it_exists():
    s = EngineSettings(model_dir="/m", dtype=torch.bfloat16, lora_rank=4, seed=3, device_type="cuda",
                       sleep_level=2, gpu_memory_utilization=0.25)
    k = engine_kwargs(s)
    assert k["dtype"] == "bfloat16" and k["max_lora_rank"] == 8 and k["enable_lora"] and k["max_loras"] == 1
    assert k["logprobs_mode"] == "processed_logprobs" and k["enable_sleep_mode"] and k["seed"] == 3
    assert "kv_cache_memory_bytes" not in k and "distributed_executor_backend" not in k
    cpu = engine_kwargs(EngineSettings("/m", torch.float32, 0, 0, "cpu", sleep_level=1, kv_cache_bytes=1 << 30,
                                       max_model_len=512, distributed=True))
    assert cpu["dtype"] == "float32" and not cpu["enable_sleep_mode"] and "enable_lora" not in cpu
    assert cpu["kv_cache_memory_bytes"] == 1 << 30 and cpu["max_model_len"] == 512
    assert cpu["distributed_executor_backend"] == "external_launcher"
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 64, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]
    with pytest.raises(ValueError, match="up to rank 512"):
        max_lora_rank(513)


def test_the_config_checks_the_colocated_settings(tmp_path):
    demo = "examples/demo.yaml"
    cfg = load_config(demo, ["rollout.backend=vllm_colocate", "rollout.vllm_sleep_level=2"])
    assert cfg.rollout.backend == "vllm_colocate" and cfg.rollout.vllm_sleep_level == 2
    with pytest.raises((ValueError, ConfigError), match="vllm_sleep_level"):
        load_config(demo, ["rollout.backend=vllm_colocate", "rollout.vllm_sleep_level=3"])
    with pytest.raises((ValueError, ConfigError), match="vllm_gpu_memory_utilization"):
        load_config(demo, ["rollout.vllm_gpu_memory_utilization=1.5"])
    with pytest.raises(ConfigError, match="set one of them"):
        load_config(demo, ["rollout.backend=vllm_colocate", "async.enabled=true", "async.servers=1"])
