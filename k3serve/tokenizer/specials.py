"""Special tokens of the K3 and Kimi-Linear/K2 tokenizers (k3-model-spec.md §7.2).

Ids are offsets from the end of the BPE ranks (163,584 in the real vocab): 256 reserved
slots follow the base vocabulary; unnamed slots are `<|reserved_token_{id}|>`.
"""

from __future__ import annotations

NUM_RESERVED_SPECIAL = 256
PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# offset from the first special id -> name
K3_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    6: "[start_header_id]",
    7: "[end_header_id]",
    9: "[EOT]",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    65: "<osagent_mode>",
    254: "[UNK]",
    255: "[PAD]",
}
K2_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    254: "[UNK]",
    255: "[PAD]",
}


def special_token_map(base_vocab: int, named: dict[int, str]) -> dict[str, int]:
    """All 256 reserved specials: name -> id."""
    out = {}
    for off in range(NUM_RESERVED_SPECIAL):
        tid = base_vocab + off
        out[named.get(off, f"<|reserved_token_{tid}|>")] = tid
    return out
