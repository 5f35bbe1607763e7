"""The chat markers of the two model families, spelled once (issue 51).

K3 (XTML): elements open with `<|open|>NAME attrs<|sep|>` and close with `<|close|>NAME<|sep|>`;
a message ends with `<|end_of_msg|>` (chat/k3_xtml.py renders, server/parsers/xtml.py lexes).
K2 family (Kimi-Linear): tool calls between section markers, in the two spellings checkpoints
use (`tool_calls_section` and `tool_call_section`); reasoning between `<think>` tags.
"""

from __future__ import annotations

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
K3_STRUCTURAL = (OPEN, CLOSE, SEP)

K2_SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
K2_SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
K2_CALL_BEGIN, K2_ARGUMENT_BEGIN, K2_CALL_END = (
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
K2_THINK = ("<think>", "</think>")
# the markers a K2 tool call is written with (the first spelling of each section marker)
K2_STRUCTURAL = (K2_SECTION_BEGIN[0], K2_SECTION_END[0], K2_CALL_BEGIN, K2_ARGUMENT_BEGIN, K2_CALL_END)
