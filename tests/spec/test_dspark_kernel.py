"""The DSpark drafter's compiled forward (kernels/cpu/fused/dspark.cpp) against its torch module, and
the proposer's greedy shortcut against its general path."""

from __future__ import annotations

import pytest
import torch

from k3serve import kernels
from k3serve.spec_decode.dspark import DSparkConfig, DSparkModel, DSparkProposer

K = kernels.get("auto")
pytestmark = pytest.mark.skipif(K is None, reason="the CPU kernels did not build")


def _draft(layers: int, vocab: int, markov: int = 0) -> DSparkModel:
    torch.manual_seed(layers * 100 + vocab)
    cfg = DSparkConfig(
        target_layer_ids=(0, 2),
        block_size=4,
        mask_token_id=vocab - 1,
        vocab_size=vocab,
        target_hidden_size=24,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=48,
        markov_rank=markov,
    )
    model = DSparkModel(cfg)
    with torch.no_grad():  # nonzero norms and positions, so every term of the forward is exercised
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return model.eval()


@pytest.mark.parametrize("layers,vocab,batch", [(1, 50, 1), (2, 301, 3), (3, 1000, 2)])
def test_the_compiled_draft_forward_equals_the_module(layers, vocab, batch):
    """Block logits [B, k, V] within fp32 summation-order noise of DSparkModel.forward (1e-5 of
    the logit scale), for 1-3 layers, vocabularies off any tile and several requests at once."""
    model = _draft(layers, vocab)
    taps, last = torch.randn(batch, 2, 24), torch.randint(0, vocab, (batch,))
    with torch.inference_mode():
        want = model(taps, last)
        got = model.block_logits(taps, last, K)
    assert got.shape == want.shape == (batch, 4, vocab)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_compiled_forward_refuses_what_it_cannot_read():
    model = _draft(1, 50)
    w = [model.fc.weight.bfloat16()] + [torch.zeros(1)] * 11
    with pytest.raises(RuntimeError, match="weight 0 must be a contiguous float32"):
        K.dspark_forward(torch.randn(1, 48), torch.tensor([1]), w, 4, 49, 1e-6)
    with pytest.raises(RuntimeError, match="6 \\+ 6 per layer weights"):
        K.dspark_forward(torch.randn(1, 48), torch.tensor([1]), w[:7], 4, 49, 1e-6)


class _Target:
    def __init__(self, vocab: int):
        from types import SimpleNamespace

        self.cfg = SimpleNamespace(vocab_size=vocab, hidden_size=24, num_layers=4)
        self.model = SimpleNamespace(kernels=K)


def test_the_greedy_shortcut_drafts_what_the_general_path_drafts():
    """A plain greedy request takes the shortcut (no processed rows: the compiled greedy chain, or
    its torch form without kernels; a step of plain requests alone: forward and chain in one
    compiled call); with a logit bias it takes draft_token's general path. With an empty bias
    every path drafts the same tokens, fewer where fewer are asked."""
    from k3serve.sampling_params import SamplingParams
    from k3serve.scheduler.request import Request

    model = _draft(2, 301, markov=8)
    prop = DSparkProposer(model, _Target(301), "greedy")
    plain = Request("a", [3, 4, 5], SamplingParams(temperature=0, max_tokens=8), None, 64)
    biased = Request("b", [3, 4, 5], SamplingParams(temperature=0, max_tokens=8, logit_bias={7: 0.0}), None, 64)
    assert prop._plain_greedy(plain) and not prop._plain_greedy(biased)
    taps = torch.randn(2, 24)
    for r in (plain, biased):
        prop.observe(r.request_id, taps)
    a, b = prop.propose([plain, biased], [4, 3])
    assert len(a.token_ids) == 4 and a.token_ids[:3] == b.token_ids and len(b.token_ids) == 3
    fused, short = prop.propose([plain, plain], [4, 2])  # all plain greedy: dspark_draft, one call
    assert fused.token_ids == a.token_ids and short.token_ids == a.token_ids[:2]
    prop.kernels = None  # the shortcut in torch (and the draft's forward through the module)
    (c,) = prop.propose([plain], [4])
    assert c.token_ids == a.token_ids


@pytest.mark.parametrize("vocab,rank", [(301, 0), (301, 8), (1280, 16), (7, 4)])
def test_the_greedy_chain_takes_the_first_maximum_like_torch(vocab, rank):
    """dspark_greedy against (block + W U[prev]).argmax() in torch, on small-integer logits and
    Markov factors (every sum exact, so ties are real and many): the first maximum, whatever
    lane or tail of the vector search it falls in."""
    g = torch.Generator().manual_seed(vocab + rank)
    B, k = 3, 4
    block = torch.randint(-3, 4, (B, k, vocab), generator=g).float()
    u = torch.randint(-2, 3, (vocab, rank), generator=g).float()
    w = torch.randint(-2, 3, (vocab, rank), generator=g).float()  # markov_w.weight [V, r]
    last = torch.randint(0, vocab, (B,), generator=g)
    got = K.dspark_greedy(
        block, last, u if rank else torch.empty(0), w.t().contiguous() if rank else torch.empty(0), [4, 2, 3]
    )
    for b in range(B):
        prev, want = int(last[b]), []
        for j in range((4, 2, 3)[b]):
            prev = int((block[b, j] + (w @ u[prev] if rank else 0)).argmax())
            want.append(prev)
        assert got[b].tolist() == want + [-1] * (k - len(want))
