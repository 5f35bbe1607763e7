"""Device-ready model state (issue 15): routed experts are module buffers, so `.to(device)` and
`.to(dtype)` move them with everything else, and MoE reads dense experts as views (no copies).

No GPU here: the `meta` device stands in for "another device" — a tensor the move missed stays
on the CPU and the check names it."""

from __future__ import annotations

import pytest
import torch

from k3serve import LLM
from k3serve.config.bundled import load_model_config
from k3serve.layers.expert_weights import ExpertWeights
from k3serve.layers.experts import expert_weights
from k3serve.models.registry import load_model
from k3serve.forward import CacheTensors
from k3serve.weights.mxfp4 import PackedMXFP4

FP32_KEPT = (
    "A_log",
    "dt_bias",
    "conv1d.weight",
    "o_norm.weight",
    "e_score_correction_bias",
)  # the spec keeps these FP32


def state(model):
    return [*model.named_parameters(), *model.named_buffers()]


@pytest.mark.parametrize("kind", ["k3", "kl"])
def test_to_device_moves_every_parameter_and_expert(tiny_k3_dir, tiny_kl_dir, kind):
    model = load_model(tiny_k3_dir if kind == "k3" else tiny_kl_dir, progress=False)
    experts = [m for m in model.modules() if isinstance(m, ExpertWeights)]
    assert experts and all(e.is_packed == (kind == "k3") for e in experts)  # K3 ships MXFP4 experts
    model.to("meta")
    stuck = [name for name, t in state(model) if t.device.type != "meta"]
    assert not stuck, stuck
    assert all(isinstance(e.value, PackedMXFP4) == (kind == "k3") for e in experts)


def test_engine_state_is_on_its_device_and_dtype(tiny_kl_dir):
    eng = LLM(str(tiny_kl_dir), dtype="bfloat16", cache_memory="16MiB", max_model_len=256).engine
    device = eng.executor.device
    for name, t in state(eng.model):
        assert t.device == device, name
        want = torch.float32 if name.endswith(FP32_KEPT) else torch.bfloat16
        assert t.dtype == want, (name, t.dtype)  # dense experts included: they are buffers
    cache = eng.executor.cache
    for t in [*cache.recurrent, *cache.conv, *cache.latent]:
        if t is not None:
            assert t.device == device
    assert all(t.dtype == torch.bfloat16 for t in cache.latent if t is not None)


def test_cache_tensors_are_made_on_the_given_device(tiny_k3_dir):
    cfg = load_model_config(tiny_k3_dir)
    cache = CacheTensors.allocate(cfg, 2, 4, 16, kv_dtype=torch.bfloat16, device="meta")
    tensors = [t for t in [*cache.recurrent, *cache.conv, *cache.latent] if t is not None]
    assert tensors and all(t.device.type == "meta" for t in tensors)


def test_dense_experts_are_read_as_views_not_copies():
    w = torch.randn(8, 16, 32)
    got = expert_weights(w, [1, 5, 6], torch.float32)
    assert [g.data_ptr() for g in got] == [w[e].data_ptr() for e in (1, 5, 6)]  # same memory
    assert all(torch.equal(g, w[e]) for g, e in zip(got, (1, 5, 6)))
    packed = PackedMXFP4.quantize(w)
    decoded = expert_weights(packed, [1, 5], torch.float32)
    assert all(torch.equal(d, packed.select(e).dequantize()) for d, e in zip(decoded, (1, 5)))


def test_an_engine_off_the_cpu_builds_no_cpu_kernels(monkeypatch):
    """The compiled kernels read CPU tensors only: on a GPU "auto" takes the triton backend, or
    the graph backend where Triton or fla-core is missing (the torch path under --enforce-eager;
    issues 46, 52) without compiling any CPU kernel and "cpp" is refused by name;
    K3SERVE_KERNELS=torch does the same for a whole process."""
    from k3serve import kernels
    from k3serve.executor.placement import resolve_mode
    from k3serve.kernels import triton as triton_kernels

    cuda = torch.device("cuda", 0)
    with_triton = triton_kernels.unavailable("cuda") is None
    assert resolve_mode("auto", cuda) == ("triton" if with_triton else "graph")
    monkeypatch.setattr(triton_kernels, "unavailable", lambda device_type: "pip install triton")
    assert resolve_mode("auto", cuda) == "graph" and resolve_mode("torch", cuda) == "torch"
    with pytest.raises(ValueError, match="pip install triton"):
        resolve_mode("triton", cuda)
    monkeypatch.undo()
    assert resolve_mode("auto", cuda, enforce_eager=True) == "torch"
    with pytest.raises(ValueError, match="CPU-only.*cuda:0"):
        resolve_mode("cpp", cuda)
    assert [resolve_mode(m, torch.device("cpu")) for m in ("auto", "cpp", "torch")] == ["auto", "cpp", "torch"]
    monkeypatch.setenv("K3SERVE_KERNELS", "torch")
    assert kernels.get("auto") is None


def test_drafters_live_on_the_targets_device(tiny_k3_dir):
    """A DSpark draft, its stored tap states and a draft_model drafter with its cache sit on the
    device the engine hands them (the meta device standing in for a GPU): before, both loaded on
    the CPU, and a DSpark draft's first proposal beside a GPU target would have multiplied a cuda
    tap state by CPU weights."""
    from types import SimpleNamespace

    from k3serve.spec_decode.draft_model import DraftModelProposer
    from k3serve.spec_decode.dspark import DSparkConfig, DSparkModel, DSparkProposer

    meta = torch.device("meta")
    target = load_model(tiny_k3_dir, progress=False)
    c = target.cfg
    draft = DSparkModel(
        DSparkConfig(
            target_layer_ids=(0, 1),
            block_size=4,
            mask_token_id=c.vocab_size - 1,
            vocab_size=c.vocab_size,
            target_hidden_size=c.hidden_size,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=48,
        )
    )
    prop = DSparkProposer(draft, SimpleNamespace(cfg=c, model=SimpleNamespace(kernels=None)), "greedy", meta)
    assert all(t.device == meta for _, t in state(prop.model))
    prop.observe("r", torch.zeros(2, c.hidden_size))  # taps back from a worker process: on the CPU
    assert prop._taps["r"].device == meta and prop._taps["r"].dtype == torch.float32
    dm = DraftModelProposer(load_model(tiny_k3_dir, progress=False), c, "greedy", 64, 2, meta)
    assert all(t.device == meta for _, t in state(dm.model))
    assert all(t.device == meta for t in [*dm.cache.recurrent, *dm.cache.conv, *dm.cache.latent] if t is not None)
