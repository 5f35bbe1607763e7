"""A small byte-level BPE trainer producing tiktoken ranks (for tiny and demo tokenizers).

Standard algorithm (Sennrich et al. 2016, byte-level as GPT-2): pre-tokenize with the Kimi
regex, start from the 256 single bytes, repeatedly merge the most frequent adjacent pair
(ties broken by the byte strings, so training is deterministic).
"""

from __future__ import annotations

from collections import Counter

import regex

from k3serve.tokenizer.specials import PAT_STR


def train_bpe(text: str, num_merges: int) -> dict[bytes, int]:
    pat = regex.compile("(?V1)" + PAT_STR)
    words = Counter(tuple(bytes([b]) for b in w.encode()) for w in pat.findall(text))
    ranks = {bytes([i]): i for i in range(256)}
    for _ in range(num_merges):
        pairs: Counter = Counter()
        for word, n in words.items():
            for a, b in zip(word, word[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        (a, b), _count = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        words = Counter({_merge(w, a, b): n for w, n in words.items()})
    return ranks


def _merge(word: tuple[bytes, ...], a: bytes, b: bytes) -> tuple[bytes, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)
