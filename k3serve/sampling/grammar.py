"""Grammar-constrained sampling on xgrammar (as vLLM and SGLang use it).

`GrammarBackend` gives xgrammar the tokenizer's vocabulary once (special and undecodable ids as
empty strings, so no grammar can ever emit them) and compiles `StructuredOutputs` into grammars,
cached by their key. Structural tags (tool calls) compile against a second vocabulary in which
the chat-markup specials (`MARKUP`) carry their own spelling, so the tag's markers match them. `Constraint` is one sequence's state: free until `start_after` has been
generated, then the grammar's matcher, then the forced `tail`. It fills a row of the batch
bitmask before sampling, advances per accepted token, checks speculative drafts (the first one
the grammar refuses, and everything after it, is cut before verification) and rolls back.
Reference: xgrammar's `GrammarMatcher` / `apply_token_bitmask_inplace`; vLLM
`v1/structured_output/backend_xgrammar.py` (read, not copied).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass

import torch

from k3serve.chat.markers import (
    END_OF_MSG,
    K2_ARGUMENT_BEGIN,
    K2_CALL_BEGIN,
    K2_CALL_END,
    K2_SECTION_BEGIN,
    K2_SECTION_END,
    K3_STRUCTURAL,
)
from k3serve.sampling_params import StructuredOutputs

FREE, OPENING, GRAMMAR, TAIL, DONE = "free", "opening", "grammar", "tail", "done"
# chat markup spelled in the tool-call vocabulary: K3 XTML, then the K2 family's tool markers
MARKUP = (
    *K3_STRUCTURAL,
    END_OF_MSG,
    K2_SECTION_BEGIN[0],
    K2_CALL_BEGIN,
    K2_ARGUMENT_BEGIN,
    K2_CALL_END,
    K2_SECTION_END[0],
)
_XGR_LOCATION = re.compile(r"\[[0-9:]+\] \S+:\d+: ")  # "[11:07:00] /project/cpp/x.cc:5082: " prefixes


def grammar_error_text(e: Exception) -> str:
    """xgrammar's message without its source-location prefixes."""
    return _XGR_LOCATION.sub("", str(e)).strip()


class GrammarError(ValueError):
    """A schema / regex / grammar that does not compile: the request's fault (a 400)."""


class GrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 256):
        import xgrammar as xgr  # imported on first use: about 2 s

        self.xgr, self.vocab_size, self.tokenizer = xgr, vocab_size, tokenizer
        self.compiler = self._compiler(())
        self._markup_compiler = None
        self.cache: OrderedDict = OrderedDict()
        self.cache_size = cache_size

    def _compiler(self, spelled: tuple[str, ...]):
        """A compiler over the vocabulary; specials are empty strings unless named in `spelled`."""
        tok, xgr = self.tokenizer, self.xgr
        keep = {tok.special_tokens[n] for n in spelled if n in tok.special_tokens}
        vocab = [
            b""
            if i >= tok.vocab_size or not tok.has_id(i) or (tok.is_special(i) and i not in keep)
            else tok.decode_bytes([i])
            for i in range(self.vocab_size)
        ]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size)
        return xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, so: StructuredOutputs):
        if so.key in self.cache:
            self.cache.move_to_end(so.key)
            return self.cache[so.key]
        try:
            grammar = self._compile(so)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with its own text
            raise GrammarError(f"the {so.kind} constraint does not compile: {grammar_error_text(e)}") from None
        self.cache[so.key] = grammar
        if len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return grammar

    def _compile(self, so: StructuredOutputs):
        c = self.compiler
        if so.markup or so.kind == "structural_tag":
            if self._markup_compiler is None:
                self._markup_compiler = self._compiler(MARKUP)
            c = self._markup_compiler
        if so.kind in ("json", "json_object"):
            schema = so.spec if so.kind == "json" else '{"type": "object"}'
            return c.compile_grammar(json_grammar(self.xgr, schema, so.any_whitespace))
        if so.kind == "regex":
            return c.compile_regex(so.spec)
        if so.kind == "choice":
            options = json.loads(so.spec)
            if not options or not all(isinstance(o, str) and o for o in options):
                raise GrammarError("choice must be a non-empty list of non-empty strings")
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(o) for o in options))
        if so.kind == "grammar":
            return c.compile_grammar(so.spec)
        return c.compile_structural_tag(so.spec)

    def constraint(self, so: StructuredOutputs) -> "Constraint":
        if so.kind == "text":  # only the free channel's closing is enforced
            return Constraint(self, None, so, frozenset())
        matcher = self.xgr.GrammarMatcher(self.compile(so), override_stop_tokens=list(so.stop_ids) or None)
        return Constraint(self, matcher, so, self._unspelled(so.markup or so.kind == "structural_tag"))

    def _unspelled(self, markup: bool) -> frozenset[int]:
        """Ids that are empty strings in the grammar's vocabulary: the matcher refuses them (and
        logs a warning for each), so a draft holding one is refused here without asking it."""
        key = "_unspelled_markup" if markup else "_unspelled_plain"
        if getattr(self, key, None) is None:
            tok = self.tokenizer
            keep = {tok.special_tokens[n] for n in MARKUP if n in tok.special_tokens} if markup else set()
            setattr(
                self,
                key,
                frozenset(
                    i
                    for i in range(self.vocab_size)
                    if i >= tok.vocab_size or not tok.has_id(i) or (tok.is_special(i) and i not in keep)
                ),
            )
        return getattr(self, key)

    def allocate(self, rows: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)  # int32 [rows, ceil(V / 32)], all allowed

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Disallowed ids of each row become -inf (in place; rows left all-ones are untouched)."""
        self.xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self.vocab_size)


# xgrammar 0.2.9 writes the characters of a length-bounded string (maxLength / minLength) as
# [^"\\\r\n], letting raw control characters into a JSON string (invalid JSON: 19 of 60 random
# runs of a maxLength-4 string broke json.loads). Its unbounded strings exclude \0-\x1f; bounded
# ones get the same class here.
_LOOSE_CHARS = r"[^\"\\\r\n]"
_XGR_JSON_CHARS = r"[^\0-\x1f\"\\\r\n]"
# ... and its classes admit UTF-8-encoded surrogates (ED A0..BF xx), which are not UTF-8: the
# text decodes them to three U+FFFD each, so a maxLength-5 string came back 8 characters long.
_JSON_CHARS = r"[^\0-\x1f\"\\\r\n\uD800-\uDFFF]"


def json_grammar(xgr, schema: str, any_whitespace: bool) -> str:
    """The EBNF xgrammar derives from a JSON schema, with string characters that JSON allows."""
    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace, strict_mode=True))
    return text.replace(_LOOSE_CHARS, _JSON_CHARS).replace(_XGR_JSON_CHARS, _JSON_CHARS)


def _only(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    bitmask[row] = 0
    bit = token_id % 32
    bitmask[row, token_id // 32] = -(2**31) if bit == 31 else 1 << bit  # int32 two's complement


class Constraint:
    """One sequence's position in free -> [opening] -> grammar -> tail -> done; every accepted
    token is recorded so `rollback(n)` can undo any n of them."""

    def __init__(self, backend: GrammarBackend, matcher, so: StructuredOutputs, unspelled: frozenset[int]):
        self.backend, self.matcher, self.so, self.unspelled = backend, matcher, so, unspelled
        self.phase = FREE if so.start_after or so.free_close else self._after_opening()
        self.pos = 0  # into free_close (OPENING) or tail (TAIL)
        self.free = 0  # free tokens so far (against free_budget)
        self.window: list[int] = []  # recent free tokens, to spot start_after
        self.history: list[tuple[str, int, int, int]] = []  # (phase, pos, free, window length) before each token

    def _after_opening(self) -> str:
        return DONE if self.matcher is None else GRAMMAR

    @property
    def active(self) -> bool:
        """Whether this sequence's next row is masked at all."""
        return self.phase in (OPENING, GRAMMAR, TAIL) or (self.phase == FREE and self.so.closes_free)

    def _forced_close(self) -> bool:
        return self.so.free_budget is not None and self.free >= self.so.free_budget

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.phase == GRAMMAR:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        elif self.phase == TAIL:
            _only(bitmask, row, self.so.tail[self.pos])
        elif self.phase == OPENING:
            _only(bitmask, row, self.so.free_close[self.pos])
        elif self.phase == FREE and self.so.closes_free:
            if self._forced_close():  # the budget is spent: the channel closes now
                _only(bitmask, row, self.so.free_close[0])
            else:
                refuse(bitmask, row, self.so.free_refused)
        # FREE (waiting for start_after) / DONE: the row stays all-allowed

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False if the constraint refuses it (nothing changes)."""
        before = (self.phase, self.pos, self.free, len(self.window))
        if self.phase == FREE and self.so.closes_free:
            if token_id == self.so.free_close[0]:
                self.phase, self.pos = OPENING, 1
                self._opened()
            elif token_id in self.so.free_refused or self._forced_close():
                return False
            else:
                self.free += 1
        elif self.phase == FREE:
            self.window.append(token_id)
            n = len(self.so.start_after)
            if tuple(self.window[-n:]) == self.so.start_after:
                self.phase = self._after_opening()
        elif self.phase == OPENING:
            if token_id != self.so.free_close[self.pos]:
                return False
            self.pos += 1
            self._opened()
        elif self.phase == GRAMMAR:
            if token_id in self.unspelled and token_id not in self.so.stop_ids:
                return False
            if not self.matcher.accept_token(token_id):
                return False
            if self.matcher.is_terminated():
                self.phase, self.pos = (TAIL, 0) if self.so.tail else (DONE, 0)
        elif self.phase == TAIL:
            if token_id != self.so.tail[self.pos]:
                return False
            self.pos += 1
            if self.pos == len(self.so.tail):
                self.phase = DONE
        self.history.append(before)
        return True

    def _opened(self) -> None:
        if self.pos == len(self.so.free_close):
            self.phase, self.pos = self._after_opening(), 0

    def rollback(self, n: int) -> None:
        for _ in range(n):
            phase, pos, free, window = self.history.pop()
            if phase == GRAMMAR:
                self.matcher.rollback(1)
            self.phase, self.pos, self.free = phase, pos, free
            del self.window[window:]

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many leading drafts the constraint accepts (state unchanged afterwards)."""
        k = 0
        for t in drafts:
            if not self.accept(t):
                break
            k += 1
        self.rollback(k)
        return k

    def fill_drafts(self, bitmask: torch.Tensor, first_row: int, drafts: list[int]) -> None:
        """Rows first_row + j: the mask after drafts[:j], for each verified position j."""
        for j in range(len(drafts) + 1):
            self.fill(bitmask, first_row + j)
            if j < len(drafts):
                self.accept(drafts[j])
        self.rollback(len(drafts))


def refuse(bitmask: torch.Tensor, row: int, token_ids) -> None:
    """Clear the bits of `token_ids` in one row of an int32 bitmask (bit 31 is the sign bit)."""
    for t in token_ids:
        bitmask[row, t // 32] &= ~(1 << (t % 32)) if t % 32 != 31 else 2**31 - 1


@dataclass
class ConstraintStats:
    """Counts for the metrics and the tests: drafts cut by the grammar before verification."""

    drafts_cut: int = 0
    masked_rows: int = 0
