"""EPLB at the model level (issue 62): expert-parallel ranks as threads over gloo
(k3serve/testing/tp_harness.py) on a checkpoint whose router is skewed on purpose (experts 0-3,
all first held by rank 0, win every token). Before a rebalance the busiest rank takes most of
the assignments; after one (the window's load, redundant replicas, experts copied between the
ranks) max/mean per rank falls to at most 1.15, and the logits before and after the move are
both as accurate as the single-process model's, their greedy tokens identical."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3serve.config.eplb import EPLBConfig
from k3serve.models.registry import load_model
from k3serve.runner.eplb import ExpertBalancer
from k3serve.testing.builder import build_tiny_checkpoint
from k3serve.testing.tp_harness import run_dp_tp_ranks, run_ranks
from tests.distributed.test_tp_model import PROMPT, assert_as_accurate, decode, greedy_logits

HOT = 4  # experts 0..HOT-1 take every token


def skew(path) -> None:
    """Raise the router's selection bias of experts 0..HOT-1 in the checkpoint's own file."""
    for f in path.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if name.endswith("e_score_correction_bias"):
                t[:HOT] += 100.0
        save_file(tensors, f, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=["k3", "kimi_linear"])
def skewed_dir(request, tmp_path_factory):
    path = build_tiny_checkpoint(tmp_path_factory.mktemp(f"skewed_{request.param}"), kind=request.param, seed=0)
    skew(path)
    return path


def per_rank(model, since: torch.Tensor, ranks: int) -> list[float]:
    """Assignments each rank's slots served since `since` (summed over the MoE layers)."""
    now = torch.stack([m.expert_load.cpu() for m in model.moe_layers()])
    return (now - since).sum(0).view(ranks, -1).sum(1).double().tolist()


def counts(model) -> torch.Tensor:
    return torch.stack([m.expert_load.cpu().clone() for m in model.moe_layers()])


def imbalance(loads: list[float]) -> float:
    return max(loads) / (sum(loads) / len(loads))


def balanced_run(path, kernels, tp, ep, prompt):
    """(logits before, logits after a rebalance, load per rank before, after, moved copies)."""
    model = load_model(path, progress=False, tp=tp, ep=ep)
    model.use_kernels(kernels)
    ranks = (ep or tp).size
    balancer = ExpertBalancer(model, EPLBConfig(window_size=10, step_interval=10, num_redundant_experts=2))
    start = counts(model)
    before = decode(model, prompt)
    load_before = per_rank(model, start, ranks)
    event = balancer.rebalance()
    start = counts(model)
    after = decode(model, prompt)
    return before, after, load_before, per_rank(model, start, ranks), event


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_dp2_ep2_rebalance_evens_the_load_and_keeps_the_logits(skewed_dir, kernels):
    prompts = [PROMPT, [(11 * i + 5) % 500 for i in range(21)]]
    outs = run_dp_tp_ranks(
        2, 1, lambda tp, ep: balanced_run(skewed_dir, kernels, tp, ep, prompts[ep.rank]), redundant_experts=2
    )
    # each DP rank counted its own rows: the group's load is their sum
    load_before = [sum(o[2][r] for o in outs) for r in range(2)]
    load_after = [sum(o[3][r] for o in outs) for r in range(2)]
    print(f"EPLB DP2+EP2 max/mean per rank: {imbalance(load_before):.3f} -> {imbalance(load_after):.3f}")
    assert imbalance(load_before) > 1.3  # the skew is real
    assert imbalance(load_after) <= 1.15
    assert outs[0][4].moved > 0 and outs[0][4].after <= 1.15
    for prompt, (before, after, *_) in zip(prompts, outs):
        ref = greedy_logits(skewed_dir, kernels=kernels, prompt=prompt)
        exact = greedy_logits(skewed_dir, kernels="torch", dtype=torch.float64, prompt=prompt)
        assert_as_accurate(before, ref, exact)
        assert_as_accurate(after, ref, exact)
        assert torch.equal(before.argmax(-1), ref.argmax(-1)) and torch.equal(after.argmax(-1), ref.argmax(-1))


def test_tp2_ep_rebalance_evens_the_load_and_keeps_the_logits(skewed_dir):
    outs = run_ranks(
        2, lambda tp: balanced_run(skewed_dir, "auto", tp, None, PROMPT), expert_parallel=True, redundant_experts=2
    )
    before, after, load_before, load_after, event = outs[0]
    print(f"EPLB TP2+EP max/mean per rank: {imbalance(load_before):.3f} -> {imbalance(load_after):.3f}")
    assert imbalance(load_before) > 1.3 and imbalance(load_after) <= 1.15
    assert outs[1][2] == load_before  # every TP rank routes every row: the same counts, the same placement
    ref = greedy_logits(skewed_dir, prompt=PROMPT)
    exact = greedy_logits(skewed_dir, kernels="torch", dtype=torch.float64, prompt=PROMPT)
    for got in (before, after):
        assert_as_accurate(got, ref, exact)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
