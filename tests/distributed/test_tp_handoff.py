"""Prefill/decode hand-offs under tensor parallelism (issues 16, 17): a hand-off carries every
KDA head whatever the layout (each TP rank adds its heads; the latent is whole on every rank),
so a TP2 prefill engine hands to a TP1 decode engine and a TP1 one to TP2, and both decode the
colocated engine's greedy tokens; the bytes are the TP1 figures (the planner's)."""

from __future__ import annotations

import pytest
import torch

from k3serve import LLM
from k3serve.cache.sizing import kda_state_bytes_per_request
from k3serve.executor.transfer import merge_heads, split_heads
from tests.engine.test_handoff import both_ways

KW = dict(cache_memory="32MiB", max_model_len=512, block_size=16)


def test_split_and_merge_heads_are_inverse():
    g = torch.Generator().manual_seed(0)
    rec = {0: torch.randn(4, 8, 8, generator=g), 2: torch.randn(4, 8, 8, generator=g)}
    conv = {0: torch.randn(3, 3 * 4 * 8, generator=g), 2: torch.randn(3, 3 * 4 * 8, generator=g)}
    parts = split_heads(rec, conv, 2)
    assert parts[1][0][0].shape == (2, 8, 8) and parts[1][1][0].shape == (3, 3 * 2 * 8)
    # rank 1's conv holds heads 2..3 of q, then of k, then of v
    assert torch.equal(parts[1][1][0][:, :16], conv[0][:, 16:32])
    assert torch.equal(parts[1][1][0][:, 16:32], conv[0][:, 48:64])
    back_rec, back_conv = merge_heads(parts)
    assert all(torch.equal(back_rec[i], rec[i]) and torch.equal(back_conv[i], conv[i]) for i in rec)


@pytest.fixture(scope="module")
def engines(tiny_kl_dir):
    tp2 = LLM(str(tiny_kl_dir), tensor_parallel_size=2, **KW)
    yield LLM(str(tiny_kl_dir), **KW), LLM(str(tiny_kl_dir), **KW), tp2
    tp2.engine.shutdown()


def test_tp2_prefill_to_tp1_decode_and_back(engines):
    colocated, tp1, tp2 = engines
    for h in both_ways(colocated, tp1, tp2, "tp"):
        assert h.state_bytes == kda_state_bytes_per_request(colocated.engine.model.cfg)  # every head
    for llm in (tp1, tp2):
        assert llm.engine.cache.num_requests == 0 and not llm.engine.handoffs.held
