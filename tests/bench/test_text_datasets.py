"""sharegpt and sonnet datasets from local files, sampled as vLLM samples them; token counts
from a local tokenizer or the server's /tokenize; the plot's title names model and hardware."""

from __future__ import annotations

import json

import pytest

from k3serve.bench.report import plot_title
from k3serve.bench.text_datasets import SONNET_BASE, sharegpt_requests, sonnet_requests, token_counter


def words(text: str) -> int:  # a stand-in tokenizer: one token per word
    return len(text.split())


def _convo(prompt_words: int, reply_words: int, tag: str) -> dict:
    return {
        "id": tag,
        "conversations": [
            {"from": "human", "value": " ".join([tag] * prompt_words)},
            {"from": "gpt", "value": " ".join(["ok"] * reply_words)},
            {"from": "human", "value": "third turn is ignored"},
        ],
    }


def test_sharegpt_takes_first_two_turns_and_filters_like_vllm(tmp_path):
    rows = [
        _convo(10, 20, "a"),
        _convo(3, 20, "short"),
        _convo(10, 2, "tiny"),
        _convo(1100, 5, "long"),
        _convo(1000, 1100, "total"),
        _convo(30, 7, "b"),
        {"id": "x", "conversations": [{"value": "one"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(rows))
    got = sharegpt_requests(path, 2, words, seed=0)
    assert sorted((r.prompt.split()[0], r.prompt_len, r.output_len) for r in got) == [("a", 10, 20), ("b", 30, 7)]
    assert all(r.prompt_token_ids is None for r in got)  # sent as text, as vLLM does
    # a fixed length skips the reply's checks: "tiny" (2-word reply) and "total" (1000 + 64) now count
    fixed = sharegpt_requests(path, 4, words, seed=0, output_len=64)
    assert {r.prompt.split()[0] for r in fixed} == {"a", "b", "tiny", "total"} and {r.output_len for r in fixed} == {64}
    lines = tmp_path / "sg.jsonl"
    lines.write_text("\n".join(json.dumps(r) for r in rows))
    assert len(sharegpt_requests(lines, 2, words, seed=0)) == 2
    with pytest.raises(ValueError, match="only 2 usable conversations"):
        sharegpt_requests(path, 5, words, seed=0)
    order = [r.prompt for r in sharegpt_requests(path, 2, words, seed=1)]
    assert order == [r.prompt for r in sharegpt_requests(path, 2, words, seed=1)]  # seeded shuffle


def test_sonnet_prompts_share_a_prefix_and_hit_the_input_length(tmp_path):
    poem = [f"line {i} of the sonnet with some words" for i in range(200)]  # 8 words each
    path = tmp_path / "sonnet.txt"
    path.write_text("\n".join(poem) + "\n")
    got = sonnet_requests(path, 6, words, seed=3, input_len=120, output_len=16, prefix_len=50)
    base = words(SONNET_BASE)  # 10
    num_input, num_prefix = round((120 - base) / 8), round((50 - base) / 8)
    prefix = SONNET_BASE + "".join(line + "\n" for line in poem[:num_prefix])
    for r in got:
        assert r.prompt.startswith(prefix) and r.prompt.count("\n") == 1 + num_input
        assert r.prompt_len == words(r.prompt) == base + 8 * num_input and r.output_len == 16
    assert len({r.prompt for r in got}) > 1
    with pytest.raises(ValueError, match="must exceed"):
        sonnet_requests(path, 1, words, seed=0, input_len=5)


def test_token_counter_reads_a_local_tokenizer(tiny_k3_dir):
    from k3serve.tokenizer.tokenizer import Tokenizer

    count = token_counter(str(tiny_k3_dir), "http://127.0.0.1:9", None)
    text = "Shall I compare thee to a summer's day?"
    assert count(text) == len(Tokenizer.from_dir(tiny_k3_dir).encode(text))
    with pytest.raises(ValueError, match="give --tokenizer DIR"):
        token_counter(None, "http://127.0.0.1:9", None)("no server listens here")


def test_plot_title_names_model_and_hardware():
    title = plot_title("moonshotai/Kimi-K3", "8xB300", "k3serve", "sharegpt", "2026-12-01T10:00:00")
    assert title == "moonshotai/Kimi-K3 on 8xB300 · k3serve · sharegpt · 2026-12-01T10:00:00"
    assert "--devices" in plot_title(None, "", "k3serve", "random", "d")
