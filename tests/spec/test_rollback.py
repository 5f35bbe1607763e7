"""Rollback: after verifying 1 + k tokens and accepting tau drafts, the KDA recurrent state and
conv window equal running the tau + 1 committed tokens without speculation (tau = 0, mid, k)."""

from __future__ import annotations

import pytest
import torch

from k3serve.models.registry import load_model
from k3serve.forward import CacheTensors, ForwardBatch
from k3serve.spec_decode.rollback import rollback_states

BS = 16


@pytest.fixture(scope="module")
def model(tiny_k3_dir):
    return load_model(tiny_k3_dir, progress=False)


def prefill(model, cache, slot, prompt, table):
    fb = ForwardBatch(torch.tensor(prompt), [len(prompt)], [0], [slot], [table], BS)
    model(fb, cache)


@pytest.mark.parametrize("tau", [0, 2, 4, -1])
def test_state_after_rollback_equals_plain_decoding(model, tau):
    """tau = -1: every draft accepted, passed as "leave the slot" (no copy): the state the pass
    left is that of the 4 + 1 tokens."""
    g = torch.Generator().manual_seed(tau)
    prompt = torch.randint(1, 500, (21,), generator=g).tolist()
    newest, drafts = 77, torch.randint(1, 500, (4,), generator=g).tolist()
    table = list(range(4))
    with torch.inference_mode():
        spec = CacheTensors.allocate(model.cfg, 2, 8, BS)
        prefill(model, spec, 1, prompt, table)
        fb = ForwardBatch(torch.tensor([newest] + drafts), [5], [len(prompt)], [1], [table], BS, verify=[0])
        records = model(fb, spec).kda_records
        assert records and set(records) == {i for i, t in enumerate(spec.recurrent) if t is not None}
        rollback_states(spec, records, [1], [tau])
        tau = len(drafts) if tau < 0 else tau
        plain = CacheTensors.allocate(model.cfg, 2, 8, BS)
        prefill(model, plain, 1, prompt, table)
        for j, t in enumerate([newest] + drafts[:tau]):  # tau + 1 ordinary decode steps
            model(ForwardBatch(torch.tensor([t]), [1], [len(prompt) + j], [1], [table], BS), plain)
            if j == tau - 1 or (tau == 0 and j == 0):
                before = [x[1].clone() for x in plain.recurrent if x is not None]
    # fp32: the verify pass runs 5 rows through each GEMM, plain decoding 1, so hidden states
    # differ in the last bits (~2e-6); a wrong position would differ by orders more
    for a, b in zip(spec.recurrent + spec.conv, plain.recurrent + plain.conv):
        if a is not None:
            torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=2e-5)
    if tau:
        wrong = [x[1] for x in spec.recurrent if x is not None]
        assert max((w - b).abs().max() for w, b in zip(wrong, before)) > 1e-3


def test_few_and_many_sequences_roll_back_alike(monkeypatch):
    """rollback_states copies one sequence at a time up to FEW sequences and gathers past it, or
    hands every layer to the compiled kda_rollback; each form moves each sequence's recorded
    state at its accepted position into its slot and leaves the other slots alone."""
    from k3serve import kernels
    from k3serve.spec_decode import rollback

    g = torch.Generator().manual_seed(3)
    rec_buf, conv_buf = torch.randn(4, 5, 2, 3, 3, generator=g), torch.randn(4, 5, 3, 6, generator=g)
    slots, accepted = [6, 1, 4, 2], [3, -1, 0, 4]

    def run(few, k=None):
        monkeypatch.setattr(rollback, "FEW", few)
        cache = CacheTensors([None, torch.zeros(8, 2, 3, 3)], [None, torch.zeros(8, 3, 6)], [None, None], BS)
        rollback_states(cache, {1: (rec_buf, conv_buf)}, slots, accepted, k)
        return cache.recurrent[1], cache.conv[1]

    one, many, compiled = run(8), run(0), run(0, kernels.get("cpp"))
    for got in (one, many, compiled):
        for j, (slot, a) in enumerate(zip(slots, accepted)):
            want = (torch.zeros(2, 3, 3), torch.zeros(3, 6)) if a < 0 else (rec_buf[j, a], conv_buf[j, a])
            assert torch.equal(got[0][slot], want[0]) and torch.equal(got[1][slot], want[1])


def test_compiled_rollback_names_bad_records():
    from k3serve import kernels

    k = kernels.get("cpp")
    live, conv = torch.zeros(4, 2, 3, 3), torch.zeros(4, 3, 6)
    with pytest.raises(RuntimeError, match="out of range"):
        k.kda_rollback([live], [conv], [torch.zeros(1, 5, 2, 3, 3)], [torch.zeros(1, 5, 3, 6)], [9], [0])
    with pytest.raises(RuntimeError, match="do not match"):
        k.kda_rollback([live], [conv], [torch.zeros(1, 5, 2, 3, 4)], [torch.zeros(1, 5, 3, 6)], [1], [0])
