"""The tiktoken rank file (`tiktoken.model`): one `base64(token_bytes) rank` per line."""

from __future__ import annotations

import base64
from pathlib import Path


def read_ranks(path: str | Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: not a tiktoken rank line ({e})") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not the dense range 0..{len(ranks) - 1}")
    return ranks


def write_ranks(path: str | Path, ranks: dict[bytes, int]) -> None:
    lines = [f"{base64.b64encode(tok).decode()} {rank}" for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    Path(path).write_text("\n".join(lines) + "\n")
