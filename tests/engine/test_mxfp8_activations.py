"""MXFP8 activations for MXFP4 experts (issue 52, the QAT recipe of k3-model-spec.md §1.3): a
checkpoint whose quantization_config asks for 8-bit float activations in groups of 32 has its
routed experts' GEMM inputs rounded through MXFP8 by every backend: each backend's experts equal
`experts_reference(a8=True)` (and differ from the unrounded sum, so the flag is not ignored),
and the engines give the torch backend's greedy tokens. Tolerance: 1e-5 of the largest |output|
(fp32 sums in another order)."""

from __future__ import annotations

import pytest
import torch

from k3serve import LLM, SamplingParams
from k3serve.layers.experts import experts_reference
from k3serve.testing.builder import build_tiny_checkpoint
from k3serve.testing.tiny_configs import tiny_k3_config

MXFP8 = dict(num_bits=8, type="float", group_size=32, strategy="group", symmetric=True, dynamic=True)
KW = dict(cache_memory="16MiB", max_model_len=256, dtype="float32", seed=0)


@pytest.fixture(scope="module")
def a8_dir(tmp_path_factory):
    raw = tiny_k3_config()
    del raw["vision_config"]
    quant = raw["text_config"]["quantization_config"]
    quant["config_groups"]["group_0"]["input_activations"] = MXFP8
    return build_tiny_checkpoint(tmp_path_factory.mktemp("a8") / "k3", config=raw)


@pytest.mark.parametrize("kernels", ["torch", "cpp", "graph", "triton"])
def test_each_backend_rounds_the_expert_inputs_through_mxfp8(a8_dir, kernels):
    llm = LLM(str(a8_dir), kernels=kernels, **KW)
    model = llm.engine.model
    layer = next(m for m in model.moe_layers())
    assert layer.a8
    backend = layer.backend
    g = torch.Generator().manual_seed(1)
    z = torch.randn(5, layer.w1.shape[2], generator=g)
    ids = torch.stack([torch.randperm(layer.w1.shape[0], generator=g)[: layer.cfg.top_k] for _ in range(5)])
    w = torch.rand(5, layer.cfg.top_k, generator=g)
    ws = (layer.w1.value, layer.w2.value, layer.w3.value)
    want = experts_reference(z, ids, w, *ws, layer.act, a8=True)
    got = backend.moe_experts(layer, z, ids, w)
    assert (got - want).abs().max() / want.abs().max() < 1e-5
    plain = experts_reference(z, ids, w, *ws, layer.act, a8=False)
    assert (plain - want).abs().max() / want.abs().max() > 1e-3  # the rounding is there to see


def test_the_engines_agree_under_mxfp8_activations(a8_dir):
    prompts = [{"prompt_token_ids": list(range(3, 30))}, {"prompt_token_ids": list(range(40, 52))}]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def tokens(kernels, **extra):
        llm = LLM(str(a8_dir), kernels=kernels, **KW, **extra)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]

    want = tokens("torch")
    assert tokens("cpp") == want
    assert tokens("graph", compilation_config={"backend": "eager"}) == want
