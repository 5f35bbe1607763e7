"""Tensor / expert parallelism at the model level, through a prefill that crosses latent blocks
and greedy decode steps (TP ranks as threads over gloo, k3serve/testing/tp_harness.py):

in float32, on the torch and kernel paths, every rank's gathered logits are as accurate as one
process's: their distance from a float64 run is at most the single-process fp32 run's own
distance from it plus 1e-5 of the logit scale; the greedy tokens are identical. A plain
|TP - one process| <= 1e-5 of the scale is finer than this model's fp32 rounding: on tiny K3
one process sits 6.6e-5 from float64 (scale 4.1) while TP2 x EP2 on the kernel path sits 4.9e-5
from it and so 7.5e-5 from the one-process run (an AMD EPYC); only the summation order of the
split sums moves. A wrong shard or a missing all-reduce moves logits by 1e-1 and more."""

from __future__ import annotations

import pytest
import torch

from k3serve.models.registry import load_model
from k3serve.forward import CacheTensors, ForwardBatch
from k3serve.testing.builder import build_tiny_checkpoint
from k3serve.testing.tiny_configs import tiny_k3_config
from k3serve.testing.tp_harness import run_ranks

BLOCK = 16
PROMPT = [(7 * i + 3) % 500 for i in range(37)]  # 37 tokens: three latent blocks


@torch.inference_mode()
def exact_logits(path) -> torch.Tensor:
    """The single-process run in float64 (torch path): the reference both fp32 runs are measured from."""
    return greedy_logits(path, kernels="torch", dtype=torch.float64)


def assert_as_accurate(got: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor) -> None:
    """`got` (a parallel run) is no farther from `exact` than `ref` (one process, fp32), + 1e-5 of scale."""
    assert got.shape == ref.shape
    own = (ref.double() - exact).abs().max().item()
    assert (got.double() - exact).abs().max().item() <= own + 1e-5 * ref.abs().max().item()


def greedy_logits(path, tp=None, kernels="auto", steps=3, dtype=torch.float32, prompt=PROMPT, ep=None) -> torch.Tensor:
    """[len(prompt) + steps, V]: every prompt row, then each greedy decode step's row (`ep`: a
    DP-attention expert group, test_dp_ep_model.py)."""
    kw = {} if tp is None else {"tp": tp}
    model = load_model(path, dtype=dtype, progress=False, ep=ep, **kw)
    model.use_kernels(kernels)
    return decode(model, prompt, steps)


def decode(model, prompt, steps=3) -> torch.Tensor:
    """Prefill then greedy decode steps on a fresh cache: [len(prompt) + steps, V] logits."""
    cache = CacheTensors.allocate(model.cfg, 2, 8, BLOCK, tp_size=model.tp.size)
    table = list(range(8))
    fb = ForwardBatch(torch.tensor(prompt), [len(prompt)], [0], [1], [table], BLOCK)
    rows = [model.compute_logits(model(fb, cache).hidden)]
    for t in range(steps):
        nxt = int(rows[-1][-1].argmax())
        fb = ForwardBatch(torch.tensor([nxt]), [1], [len(prompt) + t], [1], [table], BLOCK)
        rows.append(model.compute_logits(model(fb, cache).hidden))
    return torch.cat(rows)


def tp_logits(path, world=2, expert_parallel=False, kernels="auto", dtype=torch.float32):
    return run_ranks(world, lambda tp: greedy_logits(path, tp, kernels, dtype=dtype), expert_parallel)


@pytest.fixture(scope="module")
def k3_wide_dir(tmp_path_factory):
    """Tiny K3 with 64 expert channels: two whole MXFP4 groups, so TP2 can split them."""
    raw = tiny_k3_config()
    raw["text_config"].update(moe_intermediate_size=64)
    return build_tiny_checkpoint(tmp_path_factory.mktemp("k3wide"), config=raw)


CASES = ["kl-tp2", "kl-ep2", "k3-ep2", "k3wide-tp2"]


def _path(case, dirs):
    return dict(zip(("kl", "k3", "k3wide"), dirs))[case.split("-")[0]]


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("case", CASES)
def test_tp2_float32_logits_match_single_process(case, kernels, tiny_kl_dir, tiny_k3_dir, k3_wide_dir):
    path = _path(case, (tiny_kl_dir, tiny_k3_dir, k3_wide_dir))
    ref = greedy_logits(path, kernels=kernels)
    outs = tp_logits(path, expert_parallel=case.endswith("ep2"), kernels=kernels)
    exact = exact_logits(path)
    for got in outs:  # every rank gathers the whole vocabulary
        assert_as_accurate(got, ref, exact)
    assert torch.equal(outs[0].argmax(-1), ref.argmax(-1))


def test_mxfp4_channel_split_names_the_dimension(tiny_k3_dir):
    with pytest.raises(ValueError, match="moe_intermediate_size = 32 .* MXFP4 group of 32.*--enable-expert-parallel"):
        tp_logits(tiny_k3_dir)


def test_indivisible_heads_name_the_dimension(tiny_kl_dir):
    with pytest.raises(
        ValueError, match="linear_attn_config.num_heads = 4 is not divisible by --tensor-parallel-size 3"
    ):
        tp_logits(tiny_kl_dir, world=3)


@pytest.mark.parametrize("case", ["kl-tp2", "kl-ep2", "k3-ep2"])
def test_per_rank_weight_bytes_equal_the_planners(case, tiny_kl_dir, tiny_k3_dir):
    """Each rank's weight bytes (bf16 as stored) == planner/weights.py's per-rank prediction for the
    layout (the planner counts the vision tower too, which the engine loads beside the text model;
    channel-split experts hold 1/N of every expert, the same bytes as 1/N of the experts)."""
    from k3serve.config.bundled import load_model_config
    from k3serve.planner.weights import weight_split
    from k3serve.runner.rank_step import weight_bytes
    from k3serve.weights.schema import model_tensor_specs

    path = _path(case, (tiny_kl_dir, tiny_k3_dir, None))
    cfg = load_model_config(path)
    vision = sum(s.nbytes for s in model_tensor_specs(cfg) if s.vision)
    got = run_ranks(
        2, lambda tp: weight_bytes(load_model(path, dtype=torch.bfloat16, progress=False, tp=tp)), case.endswith("ep2")
    )
    assert got == [weight_split(cfg, path).per_rank(tp=2, ep=2) - vision] * 2
