"""Text datasets read from local files, sampled as `vllm bench serve` samples them.

- sharegpt (vLLM's `ShareGPTDataset`): a JSON list (or JSON lines) of
  {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]};
  shuffled with the seed, the first two turns are prompt and reference completion, the
  output length is the completion's token count (or --sharegpt-output-len), and pairs with
  a prompt or completion under 4 tokens, a prompt over 1,024 or a total over 2,048 are
  skipped.
- sonnet (vLLM's `SonnetDataset`): a text file of poem lines; each prompt is
  "Pick as many lines as you can from these poem lines:\\n" + the first lines up to
  --sonnet-prefix-len tokens (shared by every prompt, so it exercises prefix caching) + lines
  drawn at random up to --sonnet-input-len tokens. The prompt is sent as raw text (vLLM's
  default), so its length is counted on the raw text.

Token counts come from `count(text) -> int`: a local tokenizer (--tokenizer DIR) or the
server's own /tokenize.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from k3serve.bench.datasets import BenchRequest

SONNET_BASE = "Pick as many lines as you can from these poem lines:\n"
Counter = Callable[[str], int]


def _conversations(path: Path) -> list[dict]:
    text = path.read_text()
    try:
        rows = json.loads(text)
    except json.JSONDecodeError:
        try:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: neither a JSON list nor JSON lines ({e})") from None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}}")
    return [
        r
        for r in rows
        if isinstance(r, dict) and isinstance(r.get("conversations"), list) and len(r["conversations"]) >= 2
    ]


def sharegpt_requests(
    path: str | Path, n: int, count: Counter, seed: int, output_len: int | None = None
) -> list[BenchRequest]:
    rows = _conversations(Path(path))
    random.Random(seed).shuffle(rows)
    out = []
    for row in rows:
        if len(out) == n:
            break
        prompt, completion = (str(turn.get("value", "")) for turn in row["conversations"][:2])
        prompt_len = count(prompt)
        out_len = output_len if output_len is not None else count(completion)
        too_short = prompt_len < 4 or (output_len is None and out_len < 4)
        if too_short or prompt_len > 1024 or prompt_len + out_len > 2048:
            continue
        out.append(BenchRequest(None, prompt, out_len, prompt_len))
    if len(out) < n:
        raise ValueError(
            f"{path}: only {len(out)} usable conversations for --num-prompts {n} "
            f"(need two turns, 4..1024 prompt tokens, 2048 in all)"
        )
    return out


def sonnet_requests(
    path: str | Path,
    n: int,
    count: Counter,
    seed: int,
    input_len: int = 550,
    output_len: int = 150,
    prefix_len: int = 200,
) -> list[BenchRequest]:
    lines = [line + "\n" for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no poem lines")
    base = count(SONNET_BASE)
    if input_len <= base:
        raise ValueError(f"--sonnet-input-len {input_len} must exceed the {base}-token instruction")
    avg = sum(count(line) for line in lines) / len(lines)
    num_input = max(1, round((input_len - base) / avg))
    num_prefix = min(num_input, max(0, round((prefix_len - base) / avg)))
    prefix = lines[:num_prefix]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = SONNET_BASE + "".join(prefix + rng.choices(lines, k=num_input - num_prefix))
        out.append(BenchRequest(None, prompt, output_len, count(prompt)))
    return out


def local_tokenizer(tokenizer: str | None):
    """--tokenizer as a Tokenizer: a directory, or a hub repo id (its tokenizer files only); None
    when not given (the server's /tokenize and /detokenize stand in)."""
    if not tokenizer:
        return None
    from k3serve.tokenizer.tokenizer import Tokenizer
    from k3serve.weights.hub import is_repo_id, resolve_tokenizer

    if Path(tokenizer).is_dir():
        return Tokenizer.from_dir(tokenizer)
    if is_repo_id(tokenizer):
        return Tokenizer.from_dir(resolve_tokenizer(tokenizer))
    return None  # a name recorded only (tokenizer_id): the server counts


def token_counter(tokenizer: str | None, base_url: str, api_key: str | None) -> Counter:
    """Count with --tokenizer (a directory or a hub repo id), else with the server's /tokenize."""
    tok = local_tokenizer(tokenizer)
    if tok is not None:
        return lambda text: len(tok.encode(text))
    import httpx

    client = httpx.Client(
        base_url=base_url, timeout=60, headers={"Authorization": f"Bearer {api_key}"} if api_key else None
    )

    def count(text: str) -> int:
        try:
            r = client.post("/tokenize", json={"prompt": text})
            r.raise_for_status()
            return int(r.json()["count"])
        except (httpx.HTTPError, KeyError, ValueError) as e:
            raise ValueError(
                f"cannot count tokens with {base_url}/tokenize ({e}); "
                f"give --tokenizer DIR (a checkpoint or tokenizer folder)"
            ) from None

    return count


def as_text(requests: list, tokenizer: str | None, base_url: str, api_key: str | None) -> list:
    """Token-id prompts as their text for the chat endpoint (vLLM's openai-chat decodes its random
    prompts likewise), with a local tokenizer directory or the server's /detokenize; the lengths
    recorded stay the token counts drawn."""
    import dataclasses

    tok = local_tokenizer(tokenizer)
    if tok is not None:
        decode = tok.decode
    else:
        import httpx

        client = httpx.Client(
            base_url=base_url, timeout=60, headers={"Authorization": f"Bearer {api_key}"} if api_key else None
        )

        def decode(ids: list[int]) -> str:
            try:
                r = client.post("/detokenize", json={"tokens": ids})
                r.raise_for_status()
                return r.json()["prompt"]
            except (httpx.HTTPError, KeyError, ValueError) as e:
                raise ValueError(
                    f"cannot turn token-id prompts into text with {base_url}/detokenize ({e}); "
                    f"give --tokenizer DIR, or use /v1/completions"
                ) from None

    return [
        r
        if r.prompt is not None
        else dataclasses.replace(
            r, prompt=decode(r.prompt_token_ids), prompt_token_ids=None, prompt_tokens=len(r.prompt_token_ids)
        )
        for r in requests
    ]
