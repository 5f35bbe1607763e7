"""Incremental detokenizer with stop strings (reference: vLLM v1 `engine/detokenizer.py`).

Tokens arrive one at a time as raw bytes; an incremental UTF-8 decoder keeps the bytes of a
character split across tokens until it completes, so text never contains a torn character.
Stop strings are searched only in the new tail (they may span tokens); while a request runs,
the last len(longest stop) - 1 characters are held back from streaming, because they could
still turn out to be the start of a stop string.
"""

from __future__ import annotations

import codecs

from k3serve.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params: SamplingParams):
        self.tokenizer, self.params = tokenizer, params
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self._keep = frozenset(params.keep_special_token_ids)

    def add(self, token_id: int) -> str | None:
        """Append one token's text; the stop string it completed, if any (text is then cut)."""
        p = self.params
        if p.skip_special_tokens and self.tokenizer.is_special(token_id) and token_id not in self._keep:
            return None
        before = len(self.text)
        self.text += self._utf8.decode(self.tokenizer.decode_bytes([token_id]))
        return self._check_stop(before)

    def flush(self) -> str | None:
        """End of output: release bytes of an unfinished character (as U+FFFD)."""
        before = len(self.text)
        self.text += self._utf8.decode(b"", final=True)
        return self._check_stop(before)

    def visible_text(self, finished: bool) -> str:
        """Text safe to show: all of it when finished, else without the stop-string hold-back."""
        if finished or not self._holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self._holdback)]

    def _check_stop(self, before: int) -> str | None:
        if not self.params.stop:
            return None
        # A stop string ending in the new text starts at most len(stop) - 1 chars before it.
        start = max(0, before - self._holdback)
        hits = [(self.text.find(s, start), s) for s in self.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return None
        i, s = min(hits)
        self.text = self.text[: i + len(s)] if self.params.include_stop_str_in_output else self.text[:i]
        return s
