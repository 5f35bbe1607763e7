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
        content.append(
            {
                "token": _text(tokenizer, tid),
                "logprob": entry[tid],
                "bytes": list(tokenizer.decode_bytes([tid])),
                "top_logprobs": [
                    {"token": _text(tokenizer, t), "logprob": lp, "bytes": list(tokenizer.decode_bytes([t]))}
                    for t, lp in _top(entry, top_n)
                ],
            }
        )
    return {"content": content}


def completion_logprobs(
    tokenizer, token_ids: list[int], entries: list[dict[int, float]], top_n: int, offset: int = 0
) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        text = _text(tokenizer, tid)
        tokens.append(text)
        lps.append(entry[tid])
        tops.append({_text(tokenizer, t): lp for t, lp in _top(entry, top_n)} if top_n else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(tokenizer, entries: list) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {"ID": {"logprob", "rank",
    "decoded_token"}} for the prompt's own token and the top-n."""
    out = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": _text(tokenizer, e.token_id)}}
        for rank, (t, lp) in enumerate(e.top, 1):
            d.setdefault(str(t), {"logprob": lp, "rank": rank, "decoded_token": _text(tokenizer, t)})
        out.append(d)
    return out


def echo_logprobs(tokenizer, prompt_ids: list[int], entries: list, top_n: int) -> dict:
    """Completions `echo` + `logprobs`: the prompt's tokens in the completions format, the first
    token's logprob and top_logprobs null (nothing predicts it), as OpenAI's legacy API and
    lm-evaluation-harness's loglikelihood expect."""
    tokens, lps, tops, offsets, offset = [], [], [], [], 0
    for tid, e in zip(prompt_ids, entries):
        text = _text(tokenizer, tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if e is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(e.logprob)
        top = {_text(tokenizer, t): lp for t, lp in e.top[:top_n]}
        top.setdefault(text, e.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def join_logprobs(head: dict, tail: dict | None) -> dict:
    """Prompt logprobs followed by the generated ones, whose text offsets continue from the end
    of the prompt's token texts (a per-token decode can differ in length from the whole prompt's)."""
    if tail is None:
        return head
    end = head["text_offset"][-1] + len(head["tokens"][-1]) if head["tokens"] else 0
    shift = end - tail["text_offset"][0] if tail["text_offset"] else 0
    out = {k: head[k] + tail[k] for k in ("tokens", "token_logprobs", "top_logprobs")}
    out["text_offset"] = head["text_offset"] + [o + shift for o in tail["text_offset"]]
    return out
