"""Tokenizer loading: Kimi's `tiktoken.model` rank file or a Hugging Face `tokenizer.json`.

Kimi (K2/K3) ships `tiktoken.model` + `tokenizer_config.json` whose `added_tokens_decoder`
names the 256 reserved specials (k3-model-spec.md §7.2); the regex pre-tokenizer is fixed in
their tokenizer code and reproduced in `specials.PAT_STR`. Ordinary text never produces
special ids: specials are only emitted by the chat renderer (as ids) or on explicit request.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import tiktoken

from k3serve.tokenizer.specials import K3_SPECIALS, PAT_STR, special_token_map
from k3serve.tokenizer.tiktoken_file import read_ranks


class TokenizerError(ValueError):
    """Tokenizer files are missing or malformed."""


class Tokenizer:
    """encode/decode with named special tokens; one interface over both backends."""

    def __init__(
        self,
        *,
        tiktoken_enc: tiktoken.Encoding | None = None,
        hf=None,
        special_tokens: dict[str, int],
        vocab_size: int,
        num_base: int = 0,
    ):
        self._tk, self._hf = tiktoken_enc, hf
        if hf is not None:  # a twin that treats special-token names in text as plain text
            from tokenizers import Tokenizer as HFTokenizer

            self._hf_plain = HFTokenizer.from_str(hf.to_str())
            self._hf_plain.encode_special_tokens = True
        self.special_tokens = dict(special_tokens)
        self.special_ids = {i: s for s, i in special_tokens.items()}
        self.vocab_size = vocab_size
        self.num_base = num_base  # tiktoken: BPE ranks 0..num_base-1 (specials may sit above a gap)

    # ---- loading -------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        if (path / "tiktoken.model").is_file():
            return cls._from_tiktoken(path)
        if (path / "tokenizer.json").is_file():
            return cls._from_hf(path / "tokenizer.json")
        raise TokenizerError(f"no tiktoken.model or tokenizer.json in {path}")

    @classmethod
    def _from_tiktoken(cls, path: Path) -> "Tokenizer":
        try:
            ranks = read_ranks(path / "tiktoken.model")
        except (OSError, ValueError) as e:
            raise TokenizerError(str(e)) from e
        specials = _specials_from_config(path / "tokenizer_config.json", len(ranks))
        enc = tiktoken.Encoding(
            name=path.name or "kimi", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=specials
        )
        return cls(tiktoken_enc=enc, special_tokens=specials, vocab_size=enc.n_vocab, num_base=len(ranks))

    @classmethod
    def _from_hf(cls, file: Path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        try:
            hf = HFTokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises plain Exceptions
            raise TokenizerError(f"{file}: {e}") from e
        specials = {t.content: i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        return cls(hf=hf, special_tokens=specials, vocab_size=hf.get_vocab_size(with_added_tokens=True))

    # ---- use -----------------------------------------------------------------------
    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        ids: list[int] = []
        for part in self.encode_parts(text, allow_special):
            ids += part
        return ids

    def encode_parts(self, text: str, allow_special: bool = False) -> Iterator[list[int]]:
        """The ids of `text` in consecutive parts (one for short text). tiktoken holds the GIL for
        a whole call, so long text is encoded piece by piece (see `split_long`)."""
        if self._tk is None:
            hf = self._hf if allow_special else self._hf_plain
            yield hf.encode(text, add_special_tokens=False).ids
            return
        for piece in split_long(text):
            yield self._tk.encode(piece, allowed_special="all") if allow_special else self._tk.encode_ordinary(piece)

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: list[int]) -> bytes:
        """Raw bytes of a token sequence (specials included by name); never splits UTF-8 itself."""
        if self._tk is not None:
            return self._tk.decode_bytes(ids)
        return self._hf.decode(ids, skip_special_tokens=False).encode()

    def has_id(self, token_id: int) -> bool:
        """Whether `decode` knows this id (a model's vocabulary can be larger than its tokenizer)."""
        if self._tk is not None:
            return 0 <= token_id < self.num_base or token_id in self.special_ids
        return 0 <= token_id and self._hf.id_to_token(token_id) is not None

    def unmapped_ids(self, model_vocab_size: int) -> list[int]:
        """Ids in [0, model_vocab_size) with no text: the engine masks them out of sampling."""
        return [i for i in range(model_vocab_size) if not self.has_id(i)]

    def token_to_id(self, name: str) -> int:
        try:
            return self.special_tokens[name]
        except KeyError:
            raise TokenizerError(f"special token {name!r} is not in this tokenizer") from None

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids


SPLIT_CHARS = 1 << 16  # long texts are encoded in pieces of about this many characters


def split_long(text: str, size: int = SPLIT_CHARS) -> list[str]:
    """Cut `text` into pieces of about `size` characters, only at a single space between two
    non-space characters. Kimi's pre-tokenizer (PAT_STR) always starts a new piece at such a
    space (no pattern carries a space after a non-space character, and whitespace runs are
    not cut), so encoding the pieces one by one gives exactly the ids of the whole text
    (checked by a test against one-shot encoding). Text with no such space stays whole."""
    if len(text) <= size:
        return [text]
    out, start, n = [], 0, len(text)
    while n - start > size:
        i = text.find(" ", start + size)
        while 0 < i < n - 1 and (text[i - 1].isspace() or text[i + 1].isspace()):
            i = text.find(" ", i + 1)
        if not 0 < i < n - 1:
            break
        out.append(text[start:i])
        start = i
    out.append(text[start:])
    return out


def _specials_from_config(cfg_path: Path, base_vocab: int) -> dict[str, int]:
    if not cfg_path.is_file():
        return special_token_map(base_vocab, K3_SPECIALS)
    try:
        decoder = json.loads(cfg_path.read_text()).get("added_tokens_decoder", {})
        named = {int(k): v["content"] for k, v in decoder.items()}
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise TokenizerError(f"{cfg_path}: bad added_tokens_decoder ({e})") from e
    bad = [i for i in named if i < base_vocab]
    if bad:
        raise TokenizerError(f"{cfg_path}: special id {bad[0]} collides with the BPE ranks (0..{base_vocab - 1})")
    # ids in the config are absolute: the reserved block starts at the first named special,
    # which may sit above the last BPE rank (a gap the engine masks), never below it
    first = min(named, default=base_vocab)
    return special_token_map(first, {i - first: s for i, s in named.items()})
