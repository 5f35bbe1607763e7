"""Engine logprobs ({token id: logprob} per generated token, sampled token first) in the two
OpenAI response formats: chat (`content[]` with bytes and top_logprobs) and completions
(`tokens` / `token_logprobs` / `top_logprobs` / `text_offset`)."""

from __future__ import annotations


def _text(tokenizer, token_id: int) -> str:
    return tokenizer.decode_bytes([token_id]).decode("utf-8", errors="replace")


def _top(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:n]


def chat_logprobs(tokenizer, token_ids: list[int], entries: list[dict[int, float]], top_n: int) -> dict:
    content = []
    for tid, entry in zip(token_ids, entries):
        content.append({
            "token": _text(tokenizer, tid), "logprob": entry[tid], "bytes": list(tokenizer.decode_bytes([tid])),
            "top_logprobs": [{"token": _text(tokenizer, t), "logprob": lp, "bytes": list(tokenizer.decode_bytes([t]))}
                             for t, lp in _top(entry, top_n)],
        })
    return {"content": content}


def completion_logprobs(tokenizer, token_ids: list[int], entries: list[dict[int, float]], top_n: int,
                        offset: int = 0) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        text = _text(tokenizer, tid)
        tokens.append(text)
        lps.append(entry[tid])
        tops.append({_text(tokenizer, t): lp for t, lp in _top(entry, top_n)} if top_n else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
