"""One streamed request against an OpenAI-compatible endpoint, timed the way vLLM's
`endpoint_request_func` times it: a chunk counts as output when it carries text (content,
reasoning or completion text); usage from the final chunk gives the token counts."""

from __future__ import annotations

import json
import time

import httpx

from k3serve.bench.datasets import BenchRequest
from k3serve.bench.metrics import RequestResult


def request_body(endpoint: str, model: str | None, req: BenchRequest, sampling: dict, ignore_eos: bool) -> dict:
    body = {"max_tokens": req.output_len, "stream": True, "stream_options": {"include_usage": True}, **sampling}
    if model:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint.endswith("/chat/completions"):
        if req.prompt is None:
            raise ValueError(
                "the chat endpoint needs text prompts (use a jsonl dataset with 'prompt', "
                "or /v1/completions for token ids)"
            )
        content = req.prompt
        if req.images:
            content = [{"type": "text", "text": req.prompt}] + [
                {"type": "image_url", "image_url": {"url": url}} for url in req.images
            ]
        body["messages"] = [{"role": "user", "content": content}]
    else:
        body["prompt"] = req.prompt_token_ids if req.prompt_token_ids is not None else req.prompt
    return body


def _chunk_text(chunk: dict) -> str:
    parts = []
    for c in chunk.get("choices") or []:
        parts.append(c.get("text") or "")
        d = c.get("delta") or {}
        parts.append((d.get("content") or "") + (d.get("reasoning_content") or d.get("reasoning") or ""))
        if d.get("tool_calls"):
            parts.append("tool")
    return "".join(parts)


async def send(
    client: httpx.AsyncClient, url: str, body: dict, index: int, clock0: float, headers: dict | None = None
) -> RequestResult:
    res = RequestResult(index, False, prompt_tokens=len(body["prompt"]) if isinstance(body.get("prompt"), list) else 0)
    start = time.perf_counter()
    res.start = start - clock0
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers or {}) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message", chunk["error"]))
                    return res
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"].get("completion_tokens", 0)
                    res.prompt_tokens = chunk["usage"].get("prompt_tokens", res.prompt_tokens)
                if _chunk_text(chunk):
                    chunks += 1
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    res.chunk_times.append(now - clock0)
                    last = now
        res.latency = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks
        res.success = last is not None
        if not res.success:
            res.error = "the stream carried no output"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res
