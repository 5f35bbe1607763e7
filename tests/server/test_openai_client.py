"""The official openai client against a live k3serve (tiny K3, random weights, CPU)."""

from __future__ import annotations

import httpx

MSGS = [{"role": "user", "content": "What is the capital of France?"}]
FIXED = {"ignore_eos": True}  # random weights: make lengths deterministic


def prompt_len(base: str, messages) -> int:
    return httpx.post(base + "/tokenize", json={"messages": messages}).json()["count"]


def test_models_health_version(client, live_server):
    base, _ = live_server
    assert [m.id for m in client.models.list().data] == ["tiny-k3"]
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/version").json()["version"]


def test_chat_non_streaming_usage_and_parsing(client, live_server):
    r = client.chat.completions.create(model="tiny-k3", messages=MSGS, max_tokens=12, temperature=0, extra_body=FIXED)
    assert r.object == "chat.completion" and r.model == "tiny-k3"
    assert r.usage.prompt_tokens == prompt_len(live_server[0], MSGS)
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length"
    for text in (msg.content or "", getattr(msg, "reasoning_content", None) or ""):
        assert "<|" not in text  # no structural token ever leaks


def test_chat_streaming_equals_non_streaming(client):
    kw = dict(model="tiny-k3", messages=MSGS, max_tokens=20, temperature=0, extra_body=FIXED)
    full = client.chat.completions.create(**kw).choices[0].message
    content, reasoning, finish, usage = "", "", None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            content += c.delta.content or ""
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            finish = c.finish_reason or finish
    assert content == (full.content or "") and reasoning == (getattr(full, "reasoning_content", None) or "")
    assert finish == "length" and usage.completion_tokens == 20


def test_thinking_off_puts_everything_in_content(client):
    r = client.chat.completions.create(
        model="tiny-k3",
        messages=MSGS,
        max_tokens=8,
        temperature=0,
        extra_body={**FIXED, "chat_template_kwargs": {"thinking": False}},
    )
    assert getattr(r.choices[0].message, "reasoning_content", None) is None


def test_completions_text_ids_and_stream(client):
    r = client.completions.create(
        model="tiny-k3", prompt="The capital of France is", max_tokens=10, temperature=0, extra_body=FIXED
    )
    assert r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length"
    ids = client.completions.create(model="tiny-k3", prompt=[1, 2, 3, 4], max_tokens=5, extra_body=FIXED)
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 5
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny-k3",
            prompt="The capital of France is",
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body=FIXED,
        )
        if c.choices
    )
    assert text == r.choices[0].text
    batch = client.completions.create(model="tiny-k3", prompt=["a b", "c d e"], max_tokens=3, n=2, extra_body=FIXED)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3] and batch.usage.completion_tokens == 12


def test_n_and_seed_reproducibility(client):
    kw = dict(model="tiny-k3", messages=MSGS, max_tokens=10, temperature=1.0, n=3, seed=11, extra_body=FIXED)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    texts = [(c.message.content, getattr(c.message, "reasoning_content", None)) for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2] and a.usage.completion_tokens == 30
    assert texts == [(c.message.content, getattr(c.message, "reasoning_content", None)) for c in b.choices]
    assert len(set(texts)) > 1


def test_stop_string(client):
    base = (
        client.completions.create(model="tiny-k3", prompt="The capital", max_tokens=16, temperature=0, extra_body=FIXED)
        .choices[0]
        .text
    )
    stop = next(base[i : i + 2] for i in range(3, len(base) - 2) if "\ufffd" not in base[i : i + 2])
    r = client.completions.create(
        model="tiny-k3", prompt="The capital", max_tokens=16, temperature=0, stop=[stop], extra_body=FIXED
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == base[: base.index(stop)]


def test_logprobs_chat_and_completions(client):
    r = client.chat.completions.create(
        model="tiny-k3", messages=MSGS, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3, extra_body=FIXED
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob == max(x.logprob for x in t.top_logprobs) for t in content)  # greedy picks the top
    c = client.completions.create(
        model="tiny-k3", prompt="Hello", max_tokens=4, temperature=0, logprobs=2, extra_body=FIXED
    )
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4 and all(len(t) <= 2 for t in lp.top_logprobs)


def test_kimi_linear_chat_through_jinja_template(tiny_kl_dir):
    """The K2-family path: Jinja-rendered prompt, kimi_k2 parsers, no special-token leakage."""
    import asyncio

    from tests.server.conftest import build_parser, build_server

    args = build_parser().parse_args(
        ["serve", str(tiny_kl_dir), "--cache-memory", "16MiB", "--max-model-len", "512", "--served-model-name", "kl"]
    )
    app, state = build_server(args)
    assert state.tool_call_parser == "kimi_k2" and state.structural_ids

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 6, "ignore_eos": True})

    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert "<|" not in (msg["content"] or "") and r.json()["usage"]["completion_tokens"] == 6


def test_prefix_cache_hits_show_in_usage_and_metrics(client, live_server):
    base, _ = live_server
    shared = "The quick brown fox jumps over the lazy dog. " * 6
    client.completions.create(model="tiny-k3", prompt=shared + "One", max_tokens=2, extra_body=FIXED)
    second = client.completions.create(model="tiny-k3", prompt=shared + "Two", max_tokens=2, extra_body=FIXED)
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert second.usage.prompt_tokens_details.cached_tokens % 16 == 0
    metrics = httpx.get(base + "/metrics").text
    assert "k3serve:prefix_cache_hit_tokens" in metrics and "k3serve:prefix_cache_checkpoint_bytes" in metrics
    r = httpx.post(base + "/reset_prefix_cache").json()
    assert r["freed_blocks"] > 0 or r["dropped_checkpoints"] > 0


def test_server_with_speculative_config(tiny_k3_dir):
    """--speculative-config is honoured: spec metrics appear and greedy output is unchanged."""
    import asyncio

    from tests.server.conftest import make_app

    app, _ = make_app(tiny_k3_dir, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    plain, _ = make_app(tiny_k3_dir)
    body = {"prompt": [5, 6, 7, 5, 6, 7, 5, 6], "max_tokens": 12, "temperature": 0, "ignore_eos": True}

    async def go(a, path, **kw):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://t") as c:
            return await c.request("POST" if "json" in kw else "GET", path, **kw)

    spec_text = asyncio.run(go(app, "/v1/completions", json=body)).json()["choices"][0]["text"]
    plain_text = asyncio.run(go(plain, "/v1/completions", json=body)).json()["choices"][0]["text"]
    assert spec_text == plain_text
    metrics = asyncio.run(go(app, "/metrics")).text
    assert "k3serve:spec_decode_num_drafts" in metrics and "k3serve:spec_decode_mean_acceptance_length" in metrics
    # the adaptive policy's choices: one count per decoding request-step, by length 0..3
    chosen = [line for line in metrics.splitlines() if line.startswith("k3serve:spec_decode_draft_length_total{")]
    assert len(chosen) == 4 and sum(float(line.split()[-1]) for line in chosen) > 0
    assert "k3serve:spec_decode_skipped_steps_total" in metrics
