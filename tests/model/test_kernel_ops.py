"""The CPU kernels as torch.library ops (kernels/cpu/registry.cpp): every op passes
torch.library.opcheck (its schema says what it writes, its fake implementation in
kernels/fakes.py gives the real output's shapes and dtypes, it traces through AOT dispatch)
with the very arguments a decode, verify and mixed step of the tiny models hand it, and the
block kernels' named packs (kernels/packs.py) name the schemas' weight arguments in order."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3serve import kernels
from k3serve.forward import CacheTensors, ForwardBatch
from k3serve.kernels.packs import PACK_OPS
from k3serve.models.registry import load_model
from k3serve.spec_decode.dspark import DSparkConfig, DSparkModel
from k3serve.spec_decode.rollback import rollback_states
from k3serve.weights.mxfp4 import PackedMXFP4
from k3serve.weights.nvfp4 import PackedNVFP4

K = kernels.get("cpp")  # must build on this machine kind
BS = 16
# opcheck's utilities; test_autograd_registration asks for an autograd kernel only where an input requires grad
CHECKS = ("test_schema", "test_faketensor", "test_aot_dispatch_static")


def test_packs_name_the_schema_weight_arguments():
    for pack, op in PACK_OPS.items():
        names = [a.name for a in getattr(K, op)._schema.arguments]
        fields = [f.name for f in dataclasses.fields(pack)]
        assert names[1 : 1 + len(fields)] == fields, (pack.__name__, names)


# what kernels/cpu/registry.cpp defines
OPS = (
    "rms_norm",
    "linear",
    "glu",
    "attnres_mix",
    "mxfp4_grouped_matmul",
    "nvfp4_grouped_matmul",
    "kda_decode",
    "kda_rollback",
    "mla_decode",
    "moe_route",
    "moe_experts",
    "kda_block",
    "mla_block",
    "moe_block",
    "dspark_forward",
    "dspark_greedy",
    "dspark_draft",
)


def test_every_op_is_registered_with_a_fake():
    for name in OPS:
        op = getattr(K, name)
        assert isinstance(op, torch._ops.OpOverload) and op.namespace == K.namespace
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CPU"), name


class _Recorder:
    """The kernel library, every op call recorded with copies of its arguments as given."""

    def __init__(self, lib):
        self.lib, self.calls = lib, []

    def __getattr__(self, name):
        f = getattr(self.lib, name)
        if name not in self.lib.ops:
            return f

        def call(*args, **kwargs):
            self.calls.append((name, _copy(args), _copy(kwargs)))
            return f(*args, **kwargs)

        return call


def _copy(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_copy(v) for v in x)
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    return x


def _steps(model, recorder):
    """Prefill, decode, a verify pass beside a decode and its rollback, a mixed step: layer by
    layer (the decode stack off), so each block's op is called."""
    model.use_kernels("cpp")
    backend = model.model.backend
    backend.kernels, backend.stack_enabled = recorder, False
    g = torch.Generator().manual_seed(0)
    cache = CacheTensors.allocate(model.cfg, 4, 32, BS, kv_dtype=model.dtype)
    tables = [list(range(8 * s, 8 * s + 8)) for s in range(3)]
    a, b, c = (torch.randint(0, 500, (n,), generator=g) for n in (20, 37, 40))
    steps = [
        ([a, b], [0, 0], [0, 1], []),
        ([a[:1], b[:1]], [20, 37], [0, 1], []),
        ([a[:4], b[:1]], [21, 38], [0, 1], [0]),
        ([a[:1], c], [23, 0], [0, 2], []),
    ]
    with torch.inference_mode():
        for ids, ctx, seqs, verify in steps:
            fb = ForwardBatch(
                torch.cat(ids), [len(i) for i in ids], ctx, seqs, [tables[s] for s in seqs], BS, verify=verify
            )
            out = model(fb, cache)
            model.compute_logits(out.hidden)
            if verify:
                rollback_states(cache, out.kda_records, [0], [1], kernels=recorder)
    model.use_kernels("torch")


@pytest.mark.parametrize("kind,dtype", [("k3", torch.float32), ("kl", torch.bfloat16)], ids=["k3-fp32", "kl-bf16"])
def test_ops_pass_opcheck_with_a_real_steps_arguments(kind, dtype, tiny_k3_dir, tiny_kl_dir):
    model = load_model(tiny_k3_dir if kind == "k3" else tiny_kl_dir, dtype=dtype, progress=False)
    recorder = _Recorder(K)
    _steps(model, recorder)
    seen: dict[str, int] = {}
    for name, args, kwargs in recorder.calls:
        if seen.get(name, 0) >= 2:  # two calls of each op (a decode's and a verify's or prefill's)
            continue
        seen[name] = seen.get(name, 0) + 1
        torch.library.opcheck(getattr(K, name), args, kwargs, test_utils=CHECKS)
    want = {"rms_norm", "kda_block", "mla_block", "kda_decode", "mla_decode", "kda_rollback", "linear"}
    assert want <= set(seen), sorted(want - set(seen))


def test_the_other_ops_pass_opcheck():
    """The ops a step's blocks do not call on these models: the router and the routed experts
    alone, the grouped MXFP4 / NVFP4 matmuls, the DSpark drafter's three."""
    g = torch.Generator().manual_seed(1)
    E, N, D, O, topk = 4, 5, 64, 32, 2
    x = torch.randn(N, D, generator=g)
    ids, weights = K.moe_route(x, torch.randn(E, D, generator=g), torch.zeros(E), topk, True, True, 2.5, 1, 1)
    torch.library.opcheck(K.moe_route, (x, torch.randn(E, D, generator=g), torch.zeros(E), topk, True, True, 2.5, 1, 1))
    w1, w3 = (PackedMXFP4.quantize(torch.randn(E, O, D, generator=g)) for _ in range(2))
    w2 = PackedMXFP4.quantize(torch.randn(E, D, O, generator=g))
    experts = (w1.packed, w1.scale, w3.packed, w3.scale, w2.packed, w2.scale)
    torch.library.opcheck(K.moe_experts, (x, ids, weights, *experts, 1, 4.0, 25.0, False), test_utils=CHECKS)
    offsets = torch.tensor([0, 2, 2, 5, 5])
    torch.library.opcheck(K.mxfp4_grouped_matmul, (x, offsets, w1.packed, w1.scale), test_utils=CHECKS)
    nv = PackedNVFP4.quantize(torch.randn(E, O, D, generator=g) * 0.2)
    torch.library.opcheck(K.nvfp4_grouped_matmul, (x, offsets, nv.packed, nv.scale, nv.tables()), test_utils=CHECKS)

    cfg = DSparkConfig(
        target_layer_ids=(0, 2),
        block_size=4,
        mask_token_id=49,
        vocab_size=50,
        target_hidden_size=24,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=48,
        markov_rank=3,
    )
    draft = DSparkModel(cfg).eval().requires_grad_(False)  # served drafts are frozen
    taps, last = torch.randn(2, 48, generator=g), torch.tensor([3, 7])
    dw, (u, wt) = draft.kernel_weights(K), draft.markov_kernel_weights()
    block = K.dspark_forward(taps, last, dw, 4, 49, 1e-6)
    torch.library.opcheck(K.dspark_forward, (taps, last, dw, 4, 49, 1e-6), test_utils=CHECKS)
    torch.library.opcheck(K.dspark_greedy, (block, last, u, wt, [3, 2]), test_utils=CHECKS)
    torch.library.opcheck(K.dspark_draft, (taps, [3, 7], dw, 4, 49, 1e-6, u, wt, [3, 2]), test_utils=CHECKS)
