"""`k3serve run-batch -i in.jsonl -o out.jsonl`: OpenAI batch files, as vLLM's `run-batch`.

Each input line is `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions", "body": {...}}`. The lines run through the server's own app (in process, over
httpx's ASGI transport: the same validation, rendering, parsers and errors as HTTP), all at
once, so the engine batches them. Each output line, in input order, is OpenAI's batch output
record `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`; a line
that is not a request (not UTF-8, bad JSON or NaN, a missing field, another URL, a stream) gets
`response: null` and an `error` naming the line, and the rest run on.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass

URLS = ("/v1/chat/completions", "/v1/completions")


@dataclass
class BatchLine:
    number: int  # 1-based, for error messages
    custom_id: str | None
    url: str | None
    body: dict | None
    problem: str | None  # why this line is not a request, or None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")  # Python's json takes NaN; the request body cannot carry it


def parse_line(number: int, raw: bytes | str) -> BatchLine:
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as e:  # one bad byte costs its own line, not the file
        why = f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
        return BatchLine(number, None, None, None, f"line {number}: {why}")
    try:
        req = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        return BatchLine(number, None, None, None, f"line {number}: not JSON ({e.msg} at column {e.colno})")
    except ValueError as e:
        return BatchLine(number, None, None, None, f"line {number}: not JSON ({e})")
    if not isinstance(req, dict):
        return BatchLine(number, None, None, None, f"line {number}: a batch request must be a JSON object")
    cid, url, body = req.get("custom_id"), req.get("url"), req.get("body")
    if req.get("method", "POST") != "POST":
        return BatchLine(number, cid, url, None, f"line {number}: method must be POST")
    if url not in URLS:
        return BatchLine(number, cid, url, None, f"line {number}: url must be one of {', '.join(URLS)}, got {url!r}")
    if not isinstance(body, dict):
        return BatchLine(number, cid, url, None, f"line {number}: body must be a JSON object")
    if body.get("stream"):
        return BatchLine(number, cid, url, None, f"line {number}: streaming is not available in a batch")
    return BatchLine(number, cid, url, body, None)


def record(line: BatchLine, status: int | None = None, body: dict | None = None) -> dict:
    """One output line; `status`/`body`: the app's answer, None when the line never ran."""
    out = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id, "response": None, "error": None}
    if line.problem is not None:
        out["error"] = {"code": "invalid_request", "message": line.problem}
        return out
    out["response"] = {
        "status_code": status,
        "request_id": (body or {}).get("id", f"batch-{uuid.uuid4().hex}"),
        "body": body,
    }
    if status >= 400:
        err = (body or {}).get("error") or {}
        out["error"] = {"code": err.get("code") or err.get("type") or str(status), "message": err.get("message", "")}
    return out


async def run_lines(app, texts: list[bytes | str], concurrency: int) -> list[dict]:
    """Every non-empty line's output record, in input order."""
    import httpx

    lines = [parse_line(i + 1, t) for i, t in enumerate(texts) if t.strip()]
    gate = asyncio.Semaphore(max(1, concurrency))
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client,
    ):

        async def one(line: BatchLine) -> dict:
            if line.problem is not None:
                return record(line)
            try:
                async with gate:
                    r = await client.post(line.url, json=line.body)
            except Exception as e:  # noqa: BLE001 - a line the client cannot send fails alone, not the batch
                line.problem = f"line {line.number}: not sent ({type(e).__name__}: {e})"
                return record(line)
            try:
                body = r.json()
            except ValueError:
                body = {"error": {"message": r.text, "code": str(r.status_code)}}
            return record(line, r.status_code, body)

        return await asyncio.gather(*(one(line) for line in lines))


def run_batch(args) -> int:
    """The CLI command: build the server's app from the same flags, run the file, write the output."""
    import logging

    from k3serve.server.launch import build_server

    log = logging.getLogger("k3serve.server")
    with open(args.input_file, "rb") as f:  # decoded line by line (parse_line): a bad byte fails its line
        texts = f.read().splitlines()  # bytes split at \n and \r only: U+2028 inside a JSON string is no break
    app, state = build_server(args)
    try:
        results = asyncio.run(run_lines(app, texts, args.max_num_seqs * 4))
    finally:
        asyncio.run(state.engine.shutdown())
    with open(args.output_file, "w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    failed = sum(r["error"] is not None for r in results)
    log.info("run-batch: %d requests, %d failed, written to %s", len(results), failed, args.output_file)
    return 0
