"""Tokenizers: Kimi tiktoken rank files and Hugging Face tokenizer.json."""

from k3serve.tokenizer.tokenizer import Tokenizer, TokenizerError

__all__ = ["Tokenizer", "TokenizerError"]
