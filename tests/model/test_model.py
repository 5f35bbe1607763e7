"""Whole-model checks on tiny K3 and Kimi-Linear checkpoints from the builder (FP32)."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3serve import LLM, SamplingParams
from k3serve.layers.attnres import attnres_vector
from k3serve.models.registry import load_model
from k3serve.forward import CacheTensors, ForwardBatch

BS = 16


@pytest.fixture(scope="module", params=["k3", "kl"])
def model(request, tiny_k3_dir, tiny_kl_dir):
    return load_model(tiny_k3_dir if request.param == "k3" else tiny_kl_dir, progress=False)


def ids_for(n, seed=0):
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed))


def run(model, seqs, cache=None, ctx=None, slots=None, tables=None):
    """One forward over several sequences; returns (logits of every token, cache)."""
    cache = cache or CacheTensors.allocate(model.cfg, 4, 64, BS)
    slots = slots or list(range(len(seqs)))
    tables = tables or [list(range(16 * s, 16 * s + 16)) for s in slots]
    batch = ForwardBatch(torch.cat(seqs), [len(s) for s in seqs], ctx or [0] * len(seqs), slots, tables, BS)
    with torch.no_grad():
        return model.compute_logits(model(batch, cache).hidden), cache


def test_prefill_then_decode_equals_full_forward(model):
    ids = ids_for(70)
    full, _ = run(model, [ids])
    logits, cache = run(model, [ids[:50]])
    steps = [logits]
    for t in range(50, 70):
        lg, cache = run(model, [ids[t : t + 1]], cache, ctx=[t])
        steps.append(lg)
    assert (torch.cat(steps) - full).abs().max() < 2e-4


@pytest.mark.parametrize("chunk", [16, 64, 100])
def test_chunked_prefill_same_states_and_logits(model, chunk):
    ids = ids_for(150, seed=1)
    full, cache_full = run(model, [ids])
    cache, parts = None, []
    for s in range(0, 150, chunk):
        lg, cache = run(model, [ids[s : s + chunk]], cache, ctx=[s])
        parts.append(lg)
    assert (torch.cat(parts) - full).abs().max() < 2e-4
    for a, b in zip(cache.recurrent + cache.latent, cache_full.recurrent + cache_full.latent):
        if a is not None:
            assert (a - b).abs().max() < 1e-4


def test_fp32_runs_are_deterministic(model):
    ids = ids_for(40, seed=2)
    a, ca = run(model, [ids])
    b, cb = run(model, [ids])
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ca.conv, cb.conv) if x is not None)


def test_two_sequences_in_one_batch_equal_each_alone(model):
    s1, s2 = ids_for(33, seed=3), ids_for(21, seed=4)
    both, cache = run(model, [s1, s2])
    alone1, _ = run(model, [s1])
    alone2, _ = run(model, [s2])
    # not bitwise: GEMM blocking differs with the row count; FP32 rounding only
    assert (both[:33] - alone1).abs().max() < 5e-5 and (both[33:] - alone2).abs().max() < 5e-5
    # then a mixed step: sequence 1 decodes while a fresh sequence 3 prefills
    s3 = ids_for(9, seed=5)
    step, _ = run(model, [ids_for(1, seed=6), s3], cache, ctx=[33, 0], slots=[0, 2])
    ref1, _ = run(model, [torch.cat([s1, ids_for(1, seed=6)])])
    assert (step[0] - ref1[-1]).abs().max() < 2e-4
    assert (step[1:] - run(model, [s3])[0]).abs().max() < 5e-5


def test_k3_attnres_matches_spec_section_11(tiny_k3_dir):
    """Direct transcription of spec §6.3/§11 with per-candidate loops, reusing only the
    sub-layers (attention, MLP) of the engine's model."""
    m = load_model(tiny_k3_dir, progress=False)
    ids = ids_for(24, seed=7)
    cache = CacheTensors.allocate(m.cfg, 1, 4, BS)
    batch = ForwardBatch(ids, [24], [0], [0], [list(range(4))], BS)

    def mix(cands, w):
        scores = torch.stack([(v / torch.sqrt((v * v).mean(-1, keepdim=True) + 1e-5)) @ w for v in cands])
        p = torch.softmax(scores, 0)
        return sum(p[i][:, None] * cands[i] for i in range(len(cands)))

    with torch.no_grad():
        h, B = m.model.embed_tokens(ids), []
        for l, layer in enumerate(m.model.layers):
            w_a = layer.self_attention_res_norm.weight * layer.self_attention_res_proj.weight[0]
            w_m = layer.mlp_res_norm.weight * layer.mlp_res_proj.weight[0]
            a_in = h if not B else mix(B + [h], w_a)
            if l % m.cfg.attn_res_block_size == 0:
                B.append(h)
                P = torch.zeros_like(h)
            else:
                P = h
            P = P + layer.attn(a_in, batch, cache)
            h = P + layer.ffn(mix(B + [P], w_m))
        assert len(B) == 3
        w_o = attnres_vector(m.model.output_attn_res_norm.weight, m.model.output_attn_res_proj.weight)
        ref = m.compute_logits(m.model.norm(mix(B + [h], w_o)))
    ours, _ = run(m, [ids])
    assert (ours - ref).abs().max() < 1e-4


@pytest.mark.parametrize("which", ["k3", "kl"])
def test_bf16_stays_close_to_fp32(which, tiny_k3_dir, tiny_kl_dir):
    """bf16 path precision. Random tiny routers have near-tied scores that bf16 rounding flips
    (top-2 of 8 changes, outputs jump), so routing is made flip-free by activating every
    expert; with top-2 routing the median cosine was measured at 0.95 (min 0.46) for K3."""
    d = tiny_k3_dir if which == "k3" else tiny_kl_dir
    models = [load_model(d, progress=False), load_model(d, dtype=torch.bfloat16, progress=False)]
    for m in models:
        for moe in m.moe_layers():
            moe.cfg = dataclasses.replace(moe.cfg, top_k=moe.cfg.num_experts)
    ids = ids_for(30, seed=8)
    a, _ = run(models[0], [ids])
    b, _ = run(models[1], [ids], CacheTensors.allocate(models[1].cfg, 4, 64, BS, kv_dtype=torch.bfloat16))
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    print(f"{which} bf16 vs fp32 logits cosine: median {cos.median():.4f}, min {cos.min():.4f}")
    assert torch.isfinite(b).all() and cos.median() > 0.99 and cos.min() > 0.9


def test_kimi_linear_matches_transformers(tiny_kl_dir):
    """Independent implementation: transformers' native kimi_linear (fla hidden, CPU fallbacks)."""
    ids = ids_for(40, seed=11).tolist()
    script = Path(__file__).with_name("hf_reference.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(tiny_kl_dir), json.dumps(ids), "32"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = json.loads(proc.stdout.strip().splitlines()[-1])
    m = load_model(tiny_kl_dir, progress=False)
    ours, _ = run(m, [torch.tensor(ids)])
    max_dlogit = (ours - torch.tensor(ref["logits"])).abs().max().item()
    print(f"max |dlogit| vs transformers: {max_dlogit:.2e}")
    assert max_dlogit < 1e-4
    llm = LLM(str(tiny_kl_dir), cache_memory="16MiB", max_model_len=256)  # the serving engine
    got = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert got[0].outputs[0].token_ids == ref["tokens"]


def test_the_400m_kimi_linear_preset_has_the_benchmarked_size(tmp_path):
    """`build-tiny --kind kimi_linear --size 400m` (issue 15's bandwidth benchmark model): counted
    on the meta device, ~410 M params of which ~102 M are active (top-4 of 32 experts)."""
    from k3serve.cli import main
    from k3serve.config.model_config import ModelConfig
    from k3serve.layers.expert_weights import ExpertWeights
    from k3serve.models.registry import build_model
    from k3serve.testing.tiny_configs import kimi_linear_400m_config

    cfg = ModelConfig.from_dict(kimi_linear_400m_config())
    with torch.device("meta"):
        m = build_model(cfg)
    total = sum(t.numel() for t in [*m.parameters(), *m.buffers()])
    experts = sum(e.weight.numel() for e in m.modules() if isinstance(e, ExpertWeights))
    active = total - experts + experts * cfg.moe.top_k // cfg.moe.num_experts
    assert 400e6 < total < 420e6 and 95e6 < active < 110e6, (total, active)
    with pytest.raises(SystemExit, match="Kimi-Linear layout"):
        main(["build-tiny", str(tmp_path), "--kind", "k3", "--size", "400m"])


def test_mxfp4_kimi_linear_and_its_bf16_twin_give_the_same_tokens(tmp_path):
    """`build-tiny --kind kimi_linear --mxfp4`: routed experts packed under K3's
    compressed-tensors config (the MXFP4 row of issue 15's benchmark); `write_bf16_twin` (what
    llama.cpp converts) holds the same weights, so both generate the same greedy tokens."""
    from k3serve.cli import main
    from k3serve.testing.builder import write_bf16_twin
    from k3serve.weights.checkpoint import CheckpointIndex

    assert main(["build-tiny", str(tmp_path / "q"), "--kind", "kimi_linear", "--mxfp4"]) == 0
    names = set(CheckpointIndex.open(tmp_path / "q").tensors)
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight_packed" in names
    assert "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight" in names  # ignored: bf16
    twin = write_bf16_twin(tmp_path / "q", tmp_path / "bf16")
    twin_names = set(CheckpointIndex.open(twin).tensors)
    assert not any(n.endswith(("_packed", "_scale")) for n in twin_names)
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" in twin_names
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(3, 40))}]
    outs = [
        LLM(str(d), cache_memory="16MiB", max_model_len=256, kernels="torch").generate(prompt, greedy)
        for d in (tmp_path / "q", twin)
    ]
    assert outs[0][0].outputs[0].token_ids == outs[1][0].outputs[0].token_ids
    with pytest.raises(SystemExit, match="ships MXFP4 experts already"):
        main(["build-tiny", str(tmp_path / "k"), "--mxfp4"])
