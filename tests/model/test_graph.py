"""The graph backend's static decode step (issue 46): sync-free, compiled whole, same answers.

- sync audit: the step of tiny K3 and tiny Kimi-Linear at batch 1 and at 3 padded to 4 runs on
  fake accelerator tensors (FakeTensorMode, k3serve/testing/sync_audit.py) with a dispatch
  counter: no `_local_scalar_dense`, no dynamic-output-shape op, no op mixing host and device
  tensors (a copy, or a host index into a device tensor) besides the one input copy
  (StaticBuffers.fill); the reference decode under the same audit is caught (the control);
- it compiles with fullgraph=True (aot_eager; inductor in a slow-marked test) and runs three
  steps of one bucket with other slots, contexts and padding under error_on_recompile;
- its logits and cache writes equal the torch reference's decode (the same arithmetic), and
  padding rows leave every other slot and block untouched.
"""

from __future__ import annotations

import collections

import pytest
import torch

from k3serve.backends.graph import GraphBackend
from k3serve.backends.graph_ops import BODIES, OPS
from k3serve.config.bundled import load_model_config
from k3serve.config.model_config import LayerKind
from k3serve.forward import CacheTensors, ForwardBatch, StaticBuffers
from k3serve.models.kimi import KimiForCausalLM
from k3serve.models.registry import load_model
from k3serve.runner.graph_step import static_forward, static_sample
from k3serve.testing.sync_audit import SyncAudit, fake_gpu

BS = 4  # block size: contexts of a few tokens span several blocks


@pytest.fixture(scope="module", params=["k3", "kl"])
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(kind, tiny_k3_dir, tiny_kl_dir):
    return tiny_k3_dir if kind == "k3" else tiny_kl_dir


def tables(n_seqs: int, blocks_each: int) -> list[list[int]]:
    """Sequence j owns blocks j*blocks_each.. (interleaved ids would do as well)."""
    return [list(range(j * blocks_each, (j + 1) * blocks_each)) for j in range(n_seqs)]


def prefill(model, cache, prompts: list[list[int]], slots: list[int], tabs: list[list[int]]) -> None:
    fb = ForwardBatch(
        torch.tensor([t for p in prompts for t in p]), [len(p) for p in prompts], [0] * len(prompts), slots, tabs, BS
    )
    model(fb, cache)


def decode_reference(model, cache, ids, slots, ctx, tabs) -> torch.Tensor:
    fb = ForwardBatch(torch.tensor(ids), [1] * len(ids), ctx, slots, tabs, BS)
    return model.compute_logits(model(fb, cache).hidden)


def clone(cache: CacheTensors) -> CacheTensors:
    c = lambda ts: [None if t is None else t.clone() for t in ts]  # noqa: E731
    return CacheTensors(
        c(cache.recurrent), c(cache.conv), c(cache.latent), cache.block_size, cache.scratch_slot, cache.scratch_block
    )


def setup(model_dir, n_seqs=3, blocks_each=6):
    """A graph-backend model and a cache holding n_seqs prefilled sequences of 3..(2+n) tokens."""
    model = load_model(model_dir, progress=False)
    model.use_kernels("graph")
    cache = CacheTensors.allocate(model.cfg, 8, 32, BS, scratch=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 500, (3 + j * 2,), generator=g).tolist() for j in range(n_seqs)]
    slots = [5, 1, 3, 0][:n_seqs]
    tabs = tables(n_seqs, blocks_each)
    with torch.inference_mode():
        prefill(model, cache, prompts, slots, tabs)
    return model, cache, prompts, slots, tabs


def test_static_step_equals_the_reference_decode_and_padding_touches_scratch_only(model_dir):
    model, cache, prompts, slots, tabs = setup(model_dir)
    ctx = [len(p) for p in prompts]
    ids = [7, 8, 9]
    ref_cache, before_cache = clone(cache), clone(cache)
    torch_model = load_model(model_dir, progress=False)
    torch_model.use_kernels("torch")
    with torch.inference_mode():
        want = decode_reference(torch_model, ref_cache, ids, slots, ctx, tabs)
        buf = StaticBuffers(4, 8, BS, torch.device("cpu"), cache.scratch_slot, cache.scratch_block)
        buf.fill(ids, [1] * 3, slots, ctx, tabs)
        logits, _ = static_forward(model, buf.step, cache, ())
    # the same decode arithmetic; the MoE experts run as one batched product per projection
    # (a different summation order than the reference's per-expert matmuls)
    torch.testing.assert_close(logits[:3], want, rtol=1e-4, atol=1e-4)
    # live slots and blocks: as the reference step left them (within the MoE's summation order)
    for got, ref in zip(cache.recurrent + cache.conv, ref_cache.recurrent + ref_cache.conv):
        if got is not None:
            torch.testing.assert_close(got[slots], ref[slots], rtol=1e-4, atol=1e-4)
    live_rows = torch.tensor([b * BS + o for t in tabs for b in t for o in range(BS)])
    for got, ref in zip(cache.latent, ref_cache.latent):
        if got is not None:
            torch.testing.assert_close(got[live_rows], ref[live_rows], rtol=1e-4, atol=1e-4)
    # the padding row wrote the scratch slot and block, nothing else: every other slot and block bitwise unchanged
    other_slots = [s for s in range(cache.scratch_slot) if s not in slots]
    other_rows = torch.tensor([r for r in range(cache.scratch_block * BS) if r not in set(live_rows.tolist())])
    for got, before in zip(cache.recurrent + cache.conv, before_cache.recurrent + before_cache.conv):
        if got is not None:
            assert torch.equal(got[other_slots], before[other_slots])
            assert not torch.equal(got[cache.scratch_slot], before[cache.scratch_slot])  # padding did run there
    for got, before in zip(cache.latent, before_cache.latent):
        if got is not None:
            assert torch.equal(got[other_rows], before[other_rows])


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_static_step_compiles_whole_and_never_recompiles_in_a_bucket(model_dir, backend):
    import torch._dynamo

    model, cache, prompts, slots, tabs = setup(model_dir)
    eager_cache = clone(cache)
    buf = StaticBuffers(4, 8, BS, torch.device("cpu"), cache.scratch_slot, cache.scratch_block)
    eager_buf = StaticBuffers(4, 8, BS, torch.device("cpu"), cache.scratch_slot, cache.scratch_block)
    fn = torch.compile(static_forward, fullgraph=True, dynamic=False, backend=backend)
    torch._dynamo.reset()
    ctx = [len(p) for p in prompts]
    # three steps: 3 rows, then 2 (other slots, one more padding row), then 3 again, contexts growing
    steps = [([1, 2, 3], [0, 1, 2]), ([4, 5], [2, 0]), ([6, 7, 8], [1, 2, 0])]
    with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
        for ids, rows in steps:
            args = ([1] * len(rows), [slots[r] for r in rows], [ctx[r] for r in rows], [tabs[r] for r in rows])
            buf.fill(ids, *args)
            eager_buf.fill(ids, *args)
            got, _ = fn(model, buf.step, cache, ())
            want, _ = static_forward(model, eager_buf.step, eager_cache, ())
            # inductor fuses and reorders the torch around the ops: a few ulps
            torch.testing.assert_close(got[: len(ids)], want[: len(ids)], rtol=1e-4, atol=1e-4)
            for r in rows:
                ctx[r] += 1


def _triton_importable() -> bool:
    try:
        import fla  # noqa: F401
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize(
    "backend_name",
    [
        "graph",
        pytest.param(
            "triton",
            marks=pytest.mark.skipif(not _triton_importable(), reason="the triton backend needs triton and fla-core"),
        ),
    ],
)
@pytest.mark.parametrize("live, bucket, T", [(1, 1, 1), (3, 4, 1), (3, 4, 3)])
def test_static_step_makes_no_host_sync_on_a_fake_gpu(kind, model_dir, live, bucket, T, backend_name):
    """The triton backend's kernels enter as their custom ops' fakes (a launch needs real memory):
    the audit covers everything around them, and that they are single nodes of the step."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = load_model_config(model_dir)
    gpu = fake_gpu()
    with torch.device("meta"):
        model = KimiForCausalLM(cfg)
    # non-fake inputs allowed for the meta parameters to_empty replaces; the audit below still
    # names any op that mixes host and device tensors
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device=gpu)
        if kind == "k3":  # K3 serves packed MXFP4 experts: the fake step decodes them as the real one
            from k3serve.weights.mxfp4 import PackedMXFP4

            for moe in model.moe_layers():
                for w in (moe.w1, moe.w2, moe.w3):
                    E, o, i = w.shape
                    w.load(
                        PackedMXFP4(
                            torch.zeros(E, o, i // 2, dtype=torch.uint8, device=gpu),
                            torch.zeros(E, o, i // 32, dtype=torch.uint8, device=gpu),
                        )
                    )
        model.use_kernels(backend_name)
        assert isinstance(model.model.backend, GraphBackend)
        cache = CacheTensors.allocate(cfg, 8, 32, BS, device=gpu, scratch=True, spare=6)  # spares 9..14
        # the padded decode bucket samples with grammar bits and penalties too (their counts from
        # the rows' histories), still one input copy and no sync
        extras = T == 1 and live == 3
        V = cfg.vocab_size
        buf = StaticBuffers(
            bucket, 8, BS, torch.device(gpu), cache.scratch_slot, cache.scratch_block, T, 0,
            -(-V // 64) if extras else 0, (8, 4) if extras else (0, 0), V,
        )  # fmt: skip
        penal = dict(presence=0.5, frequency=0.2, repetition=1.1) if extras else {}
        rows = [
            dict(temperature=0.7 * j, top_k=5 * j, top_p=0.9, min_p=0.0, seed=j, position=4, **penal)
            for j in range(live)
        ]
        bits = torch.randint(-(2**31), 2**31, (live, -(-V // 32)), dtype=torch.int64).to(torch.int32)
        with SyncAudit() as fill_audit:
            lens = [1] * live if T == 1 else [3, 1, 2][:live]  # a verify step: 1 + drafts tokens a sequence
            buf.fill(
                list(range(1, sum(lens) + 1)),
                lens,
                [5, 1, 3][:live] if T == 1 else [[5, 9, 10], [1, 11, 12], [3, 13, 14]][:live],  # verify: slot rows
                [3, 9, 17][:live],
                tables(live, 6),
                rows if T == 1 else None,
                bits if extras else None,
                [([1, 2, 3], [4, 4]), ([5], []), ([6, 7, 8, 9, 10], [11, 12, 13])] if extras else None,
            )
        assert (buf.step.token_mask is not None) == extras and (buf.step.output_ids is not None) == extras
        bias = torch.zeros(1, cfg.vocab_size, device=gpu)
        backend = model.model.backend
        audits = []
        for ops in (BODIES, OPS):  # inside the custom ops' bodies, then the step as compiled sees it
            backend.ops = ops
            with torch.inference_mode(), SyncAudit() as audit:
                logits, _ = static_forward(model, buf.step, cache, ())
                if T == 1:
                    ids, faults, _ = static_sample(model, buf.step, cache, (), bias)  # sampling fused: [B] ids back
                    assert ids.device.type == gpu and tuple(ids.shape) == tuple(faults.shape) == (bucket,)
            assert logits.device.type == gpu and tuple(logits.shape) == (bucket * T, cfg.vocab_size)
            audits.append(audit)
        own = [op for op in audits[0].ops if op.startswith("k3serve.") and not op.startswith("k3serve.triton_")]
        assert any("k3serve.kda_" in op or "k3serve.rms_norm" in op for op in audits[1].ops) and not own
        if backend_name == "triton":  # KDA, MLA and the experts are the kernels' ops, one node each
            names = {op.split(".")[1] for op in audits[1].ops if op.startswith("k3serve.triton_")}
            assert {
                "triton_kda_decode" if T == 1 else "triton_kda_verify",
                "triton_mla_decode",
                "triton_moe_experts",
            } <= names
        # the control: the same decode through the reference path syncs, and the audit sees it
        model.use_kernels("torch")
        with torch.inference_mode(), SyncAudit() as control:
            try:  # its index lists go up with torch.tensor(list, device=), which a fake device refuses
                model(
                    ForwardBatch(
                        torch.arange(1, live + 1, device=gpu),
                        [1] * live,
                        [3, 9, 17][:live],
                        [5, 1, 3][:live],
                        tables(live, 6),
                        BS,
                    ),
                    cache,
                )
            except (NotImplementedError, RuntimeError) as e:
                control.cross.append(type(e).__name__)
        assert control.cross
    for audit in audits:
        assert not audit.syncs and not audit.cross, (audit.syncs, audit.cross)
    assert fill_audit.cross == ["aten.copy_.default"], fill_audit.cross  # the step's one input copy


# the static step's aten + k3serve ops a layer, dispatched before compilation (issue 46's budget:
# at most 40; the torch reference's decode dispatches about 144 a layer on tiny K3)
OP_BUDGET = 40


def test_static_step_stays_inside_the_op_budget(model_dir):
    model, cache, prompts, slots, tabs = setup(model_dir)
    buf = StaticBuffers(4, 8, BS, torch.device("cpu"), cache.scratch_slot, cache.scratch_block)
    buf.fill([1, 2, 3], [1] * 3, slots, [len(p) for p in prompts], tabs)
    with torch.inference_mode(), SyncAudit() as audit:
        static_forward(model, buf.step, cache, ())
    per_layer = len(audit.ops) / model.cfg.num_layers
    assert per_layer <= OP_BUDGET, (per_layer, collections.Counter(audit.ops).most_common(8))


def test_static_verify_equals_the_reference_verify_pass(model_dir):
    """A verify step of 3 sequences (1 + 2, 1 + 0 and 1 + 1 tokens: the shorter ones padded to
    T = 3) in a bucket of 4: logits of every row equal the reference's verify pass, and the state
    after each real position sits in the slot its row names (cache/draft_slots.py) equal to the
    reference's record of it, the live slot holding position 0's; no other slot changes.
    Compiled (aot_eager), a second step with other draft counts and rows does not recompile."""
    import torch._dynamo

    model, cache, prompts, slots, tabs = setup(model_dir)
    spares = CacheTensors.allocate(model.cfg, 8, 32, BS, scratch=True, spare=8)
    for name in ("recurrent", "conv", "latent"):  # the prefilled cache, now with spare slots 9..16
        for got, t in zip(getattr(spares, name), getattr(cache, name)):
            if got is not None:
                got[: t.shape[0]] = t
    cache = spares
    rows = [[slots[0], 9, 10], [slots[1], 11, 12], [slots[2], 13, 14]]
    ctx, lens, ids = [len(p) for p in prompts], [3, 1, 2], [11, 12, 13, 21, 31, 32]
    ref_cache = clone(cache)
    before = clone(cache)
    torch_model = load_model(model_dir, progress=False)
    torch_model.use_kernels("torch")
    with torch.inference_mode():
        fb = ForwardBatch(torch.tensor(ids), lens, ctx, slots, tabs, BS, verify=[0, 1, 2])
        out = torch_model(fb, ref_cache)
        want = torch_model.compute_logits(out.hidden)
        buf = StaticBuffers(4, 8, BS, torch.device("cpu"), cache.scratch_slot, cache.scratch_block, T=3)
        buf.fill(ids, lens, rows, ctx, tabs)
        torch._dynamo.reset()
        fn = torch.compile(static_forward, fullgraph=True, dynamic=False, backend="aot_eager")
        logits, _ = fn(model, buf.step, cache, ())
    torch.testing.assert_close(logits[:6], want, rtol=1e-4, atol=1e-4)
    assert len(out.kda_records) == model.cfg.layer_kinds.count(LayerKind.KDA)
    for layer, (rec, conv) in out.kda_records.items():
        for j, n in enumerate(lens):  # each sequence's real positions, each in its own slot
            for t in range(n):
                torch.testing.assert_close(cache.recurrent[layer][rows[j][t]], rec[j, t], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(cache.conv[layer][rows[j][t]], conv[j, t], rtol=1e-4, atol=1e-4)
    named = {s for r in rows for s in r} | {cache.scratch_slot}
    for got, old in zip(cache.recurrent + cache.conv, before.recurrent + before.conv):
        if got is not None:
            others = [s for s in range(got.shape[0]) if s not in named]
            assert torch.equal(got[others], old[others])
    with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
        buf.fill([5, 6, 7, 8], [2, 2], [rows[0][::-1], rows[1][::-1]], [c + 3 for c in ctx[:2]], tabs[:2])
        fn(model, buf.step, cache, ())
