"""Request sets: random, shared-prefix, low-/high-entropy synthetic, and jsonl files. Every
request carries the exact token ids it will send (or its text when the file gives text);
sharegpt and sonnet files are in `text_datasets.py`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass
class BenchRequest:
    prompt_token_ids: list[int] | None
    prompt: str | None
    output_len: int
    prompt_tokens: int | None = None  # counted by a tokenizer when the prompt is text
    images: list[str] | None = None  # data URLs sent as image_url parts (chat endpoint)

    @property
    def prompt_len(self) -> int:
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        return self.prompt_tokens or 0

    def to_dict(self) -> dict:
        return asdict(self)


def _lens(rng, n: int, mean: int, ratio: float) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)] if ratio else [mean] * n


def random_requests(
    n: int, input_len: int, output_len: int, range_ratio: float, vocab: tuple[int, int], seed: int
) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    ins, outs = _lens(rng, n, input_len, range_ratio), _lens(rng, n, output_len, range_ratio)
    return [BenchRequest(rng.integers(*vocab, size=i).tolist(), None, o) for i, o in zip(ins, outs)]


def shared_prefix_requests(
    n: int, prefix_len: int, share_ratio: float, input_len: int, output_len: int, vocab: tuple[int, int], seed: int
) -> list[BenchRequest]:
    """`share_ratio` of the requests start with the same `prefix_len` tokens."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(*vocab, size=prefix_len).tolist()
    out = []
    for i in range(n):
        tail = rng.integers(*vocab, size=input_len).tolist()
        shared = i < round(n * share_ratio)
        out.append(
            BenchRequest(
                (prefix if shared else rng.integers(*vocab, size=prefix_len).tolist()) + tail, None, output_len
            )
        )
    return out


def entropy_requests(
    n: int, input_len: int, output_len: int, low: bool, vocab: tuple[int, int], seed: int
) -> list[BenchRequest]:
    """low: a short random segment repeated (code-like, predictable); high: uniform random ids."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        if low:
            seg = rng.integers(*vocab, size=max(2, input_len // 8)).tolist()
            ids = (seg * (input_len // len(seg) + 1))[:input_len]
        else:
            ids = rng.integers(*vocab, size=input_len).tolist()
        out.append(BenchRequest(ids, None, output_len))
    return out


def random_mm_requests(
    n: int, input_words: int, output_len: int, images: int, size: tuple[int, int], seed: int
) -> list[BenchRequest]:
    """vLLM's random-mm: random words plus `images` random-pixel PNGs of `size` per request."""
    import base64
    import io

    from PIL import Image

    rng = np.random.default_rng(seed)
    words = ["red", "blue", "cat", "sky", "tree", "river", "stone", "light", "house", "road"]
    out = []
    for _ in range(n):
        text = " ".join(rng.choice(words, size=input_words)) + ". What is in the image?"
        urls = []
        for _ in range(images):
            buf = io.BytesIO()
            Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8")).save(buf, format="PNG")
            urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
        out.append(BenchRequest(None, text, output_len, None, urls))
    return out


def jsonl_requests(path: str | Path, n: int | None, output_len: int) -> list[BenchRequest]:
    out = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON ({e})") from None
        if "prompt_token_ids" not in row and "prompt" not in row:
            raise ValueError(f"{path}:{lineno}: needs 'prompt' or 'prompt_token_ids'")
        out.append(BenchRequest(row.get("prompt_token_ids"), row.get("prompt"), int(row.get("output_len", output_len))))
    return out[:n] if n else out
