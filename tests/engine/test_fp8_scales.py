"""The fp8 latent cache with per-layer scales (issue 50): scales from the checkpoint's
`self_attn.k_scale` or calibrated on the first rows each MLA layer writes (--calculate-kv-scales);
every backend reads and writes them; the error against a float32 cache within fp8's bound where
a unit scale saturates; the equality suite in its own mode; the scales travel with a P/D hand-off
and with the disk prefix tier across a restart.

Error bound (e4m3: 3 mantissa bits, smallest normal 2^-6, subnormal step 2^-9, max 448): a value
x stored as fp8(x / s) * s is off by at most 2^-4 |x| + 2^-10 s while |x| / s <= 448."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3serve import LLM, SamplingParams
from k3serve.engine.handoff import capture, from_bytes, install, to_bytes
from k3serve.forward.cache import K_SCALE_RANGE
from k3serve.forward.cache import from_cache
from k3serve.cache.prefix_cache import block_hashes
from tests.engine.test_state_dtype import LOOPY, run, toks

KW = dict(kernels="torch", cache_memory="32MiB", max_model_len=256, seed=0, dtype="float32", kv_cache_dtype="fp8")


def _rewrite(src, dst, fn):
    """A copy of checkpoint `src` with fn(name, tensor) -> tensor | None applied to every tensor
    and `extra(shard tensors)` -> new tensors added to the shard holding them."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    for shard in sorted(dst.glob("*.safetensors")):
        tensors = load_file(shard)
        out = {}
        for name, t in tensors.items():
            out.update(fn(name, t))
        save_file(out, str(shard), metadata={"format": "pt"})
        for name in out:
            index["weight_map"][name] = shard.name
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


@pytest.fixture(scope="module")
def loud_k3(tiny_k3_dir, tmp_path_factory):
    """Tiny K3 whose latent rows reach ~1,000 (the kv_a norm's weights x 600): past fp8's 448,
    where a unit scale saturates."""

    def louder(name, t):
        return {name: t * 600 if name.endswith("kv_a_layernorm.weight") else t}

    return _rewrite(tiny_k3_dir, tmp_path_factory.mktemp("loud") / "k3", louder)


def _rows(llm, prompt):
    """Every MLA layer's cached values of `prompt`'s positions after a 1-token request: fp32 [L, 576]."""
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1))
    eng = llm.engine
    cache = eng.executor.cache
    bs = cache.block_size
    blocks = [eng.cache.blocks.cached[h] for h in block_hashes(prompt, bs)]  # whole blocks, still cached
    rows = torch.cat([torch.arange(b * bs, (b + 1) * bs) for b in blocks])
    return {i: from_cache(t[rows], cache.kv_scale(i)) for i, t in enumerate(cache.latent) if t is not None}


def test_calibrated_scales_keep_fp8_within_its_bound_where_unit_scale_saturates(loud_k3):
    prompt = toks(64, 3)
    ref = _rows(LLM(str(loud_k3), **{**KW, "kv_cache_dtype": "auto"}), prompt)
    calibrated = LLM(str(loud_k3), **KW, calculate_kv_scales=True)
    got = _rows(calibrated, prompt)
    unit = _rows(LLM(str(loud_k3), **KW), prompt)
    scales = calibrated.engine.executor.cache.latent_scale
    assert max(r.abs().max().item() for r in ref.values()) > 448  # the unit scale's range is exceeded
    first = min(ref)  # the first MLA layer: the layers before it are the same in both engines,
    r, s = ref[first], scales[first].item()  # so its rows differ by the fp8 encoding alone
    # its scale came from the first rows written: these whole blocks and the prompt's last row
    assert r.abs().max().item() / K_SCALE_RANGE <= s * (1 + 1e-6) and s < 1.2 * r.abs().max().item() / K_SCALE_RANGE
    assert ((got[first] - r).abs() <= r.abs() * 2**-4 + s * 2**-10).all()
    assert (unit[first] - r).abs().max() > 0.2 * r.abs().max()  # the unit scale clips at 448
    # later layers also see the earlier layers' rounding; the calibrated cache stays the closer
    for i, r in ref.items():
        assert (got[i] - r).abs().max() < (unit[i] - r).abs().max(), i


def _with_k_scale(value):
    """A checkpoint rewrite adding compressed-tensors' per-layer kv scales (MLA reads k_scale)."""

    def fn(name, t):
        out = {name: t}
        if name.endswith("kv_a_layernorm.weight"):
            base = name[: -len("kv_a_layernorm.weight")]
            out[base + "k_scale"] = torch.tensor([value])
            out[base + "v_scale"] = torch.tensor([1.0])  # written by the scheme; MLA reads k_scale
        return out

    return fn


# triton prefills through fla's chunk_kda under the interpreter: 83 s here, so `make test-slow`
@pytest.mark.parametrize("kernels", ["cpp", "graph", pytest.param("triton", marks=pytest.mark.slow)])
def test_every_backend_gives_the_torch_backends_tokens_under_scales(tiny_k3_dir, tmp_path, kernels):
    """The graph op reads rows x s as the reference does; the C++ and Triton kernels read the raw
    rows with the scale folded into the queries / softmax scale and the output (attention is
    linear in the rows): another rounding order, the same tokens on the tiny model, under the
    checkpoint's scales (every backend reads the same s). Calibrated scales come from each
    backend's own first rows: they agree with the torch backend's to float32 rounding (a scale
    off in its 6th digit moves fp8 roundings, which flips a near-tied token of the tiny model
    on an AVX2 build: so tokens are compared under the checkpoint's scales). (On `loud_k3`, whose
    attention logits are ~10^5, the rounding order alone flips a late token.)"""
    prompts = [toks(30 + 5 * i, 40 + i) for i in range(3)]
    scaled = str(_rewrite(tiny_k3_dir, tmp_path / "scaled", _with_k_scale(0.0625)))
    extra = {"compilation_config": {"backend": "eager"}} if kernels in ("graph", "triton") else {}
    want = run(LLM(scaled, **KW), prompts)
    llm = LLM(scaled, **{**KW, "kernels": kernels}, **extra)
    assert {s.item() for s in llm.engine.executor.cache.latent_scale.values()} == {0.0625}
    assert run(llm, prompts) == want
    ref = LLM(str(tiny_k3_dir), **KW, calculate_kv_scales=True)
    calibrated = LLM(str(tiny_k3_dir), **{**KW, "kernels": kernels}, calculate_kv_scales=True, **extra)
    run(ref, prompts[:1]), run(calibrated, prompts[:1])
    got, ref_s = calibrated.engine.executor.cache.latent_scale, ref.engine.executor.cache.latent_scale
    assert all(s.item() != 1.0 for s in got.values())  # calibrated, not the unit scale
    assert all(abs(got[i].item() / ref_s[i].item() - 1) < 1e-4 for i in ref_s)


def test_calibrated_fp8_keeps_the_equality_suite(tiny_k3_dir):
    path = str(tiny_k3_dir)
    kw = {**KW, "calculate_kv_scales": True}
    prefix = toks(40, 1)
    prompts = [prefix + toks(5 + i, 10 + i) for i in range(4)]
    llm = LLM(path, **kw)
    together = run(llm, prompts)
    assert not llm.engine.executor.cache.calibrating  # every layer took its scale from the first step
    assert together == [run(llm, [p])[0] for p in prompts]  # batched == alone (and hits == first run)
    assert llm.engine.cache.checkpoints.stats.hit_tokens >= 3 * 32
    cold = LLM(path, **kw, enable_prefix_caching=False)
    assert run(cold, prompts) == together  # prefix hit == recompute (the same first step calibrates both)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "adaptive": False}  # all verified
    spec = LLM(path, **kw, speculative_config=ngram)
    # both calibrate on the same first rows: the same prompt, and prefix caching on in both (its
    # checkpoints split a prefill at block boundaries, and the first piece sets the scale)
    first = LLM(path, **kw)
    run(spec, prompts[:1]), run(first, prompts[:1])
    assert run(spec, prompts, LOOPY) == run(first, prompts, LOOPY)  # speculation lossless
    assert spec.engine.spec.stats.accepted_tokens > 0


def test_checkpoint_k_scale_is_read_and_checked(tiny_k3_dir, tmp_path):
    good = _rewrite(tiny_k3_dir, tmp_path / "good", _with_k_scale(0.25))
    llm = LLM(str(good), **KW)
    assert {round(s.item(), 6) for s in llm.engine.executor.cache.latent_scale.values()} == {0.25}
    assert run(llm, [toks(20, 5)])
    plain = LLM(str(good), **{**KW, "kv_cache_dtype": "auto"})  # not fp8: the scales are not used
    assert plain.engine.executor.cache.latent_scale is None
    bad = _rewrite(tiny_k3_dir, tmp_path / "bad", _with_k_scale(0.0))
    with pytest.raises(Exception, match=r"self_attn\.k_scale.*|scale must be finite") as e:
        LLM(str(bad), **KW)
    assert "k_scale" in str(e.value) and "scale must be finite" in str(e.value)


def test_calculate_kv_scales_needs_fp8(tiny_k3_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype fp8"):
        LLM(str(tiny_k3_dir), **{**KW, "kv_cache_dtype": "auto"}, calculate_kv_scales=True)


def test_a_handoff_carries_its_scales_into_another_scale(loud_k3):
    """Prefill engine calibrated on one prompt, decode engine on another: the installed rows
    are the sender's values re-encoded under the receiver's scale, within fp8's bound."""
    a = LLM(str(loud_k3), **KW, calculate_kv_scales=True)
    b = LLM(str(loud_k3), **KW, calculate_kv_scales=True)
    run(a, [toks(48, 7)]), run(b, [toks(16, 8)])
    ca, cb = a.engine.executor.cache, b.engine.executor.cache
    prompt = list(range(1, 33))
    table_a, table_b = [0, 1], [2, 3]
    torch.manual_seed(0)
    for i, t in enumerate(ca.latent):
        if t is not None:
            values = torch.randn(32, t.shape[1]) * 300
            t[:32] = (values / ca.latent_scale[i]).clamp(-448, 448).to(t.dtype)
    h = from_bytes(to_bytes(capture(a.engine.executor, ca.block_size, "r", prompt, 5, table_a, 0)))
    assert h.latent_scale == {i: float(s) for i, s in ca.latent_scale.items()}
    install(b.engine.executor, h, cb.block_size, table_b, 0)
    for i, t in enumerate(cb.latent):
        if t is None:
            continue
        sent = from_cache(ca.latent[i][:32], ca.latent_scale[i])
        got = from_cache(t[32:64], cb.latent_scale[i])
        s = cb.latent_scale[i].item()
        assert ((got - sent).abs() <= sent.abs() * 2**-4 + s * 2**-10 + (sent.abs() - 448 * s).clamp(min=0)).all()


def test_disk_tier_keeps_calibrated_scales_across_a_restart(tiny_k3_dir, tmp_path):
    kw = {**KW, "calculate_kv_scales": True, "kv_offloading_dir": str(tmp_path / "tier"), "kv_offloading_size": 0.05}
    prefix, longer = toks(48, 21), toks(48, 21) + toks(7, 22)
    first = LLM(str(tiny_k3_dir), **kw)
    run(first, [prefix])
    want = run(first, [longer])
    scales = {i: s.item() for i, s in first.engine.executor.cache.latent_scale.items()}
    first.engine.shutdown()
    saved = list((tmp_path / "tier").glob("*/kv_scales.json"))
    assert len(saved) == 1 and {int(k): v for k, v in json.loads(saved[0].read_text()).items()} == scales
    again = LLM(str(tiny_k3_dir), **kw)
    cache = again.engine.executor.cache
    assert not cache.calibrating and {i: s.item() for i, s in cache.latent_scale.items()} == scales
    assert run(again, [toks(5, 99)]) and {i: s.item() for i, s in cache.latent_scale.items()} == scales
    assert run(again, [longer]) == want  # its prefix served from the disk tier, read under the saved scales
    assert again.engine.tiers.index.stats["disk"].hits > 0


def test_engines_sharing_a_directory_never_read_each_others_scales(loud_k3, tmp_path):
    """Issue 63 item 1: engines started together on one directory each calibrate their own
    scales. Before: B found A's packs and read A's latents under B's scales (wrong text). Now
    each scale set writes where only engines under the same scales read; the first saved set
    is what a later engine adopts."""
    kw = {**KW, "calculate_kv_scales": True, "kv_offloading_dir": str(tmp_path / "tier"), "kv_offloading_size": 0.05}
    a, b = LLM(str(loud_k3), **kw), LLM(str(loud_k3), **kw)  # both start before either saved scales
    run(a, [toks(48, 31)]), run(b, [toks(9, 32)])  # their first rows differ: so do their scales
    sa, sb = ({i: s.item() for i, s in e.engine.executor.cache.latent_scale.items()} for e in (a, b))
    assert sa != sb
    longer = toks(48, 31) + toks(9, 33)
    a.engine.tiers.flush()  # A's packs of the shared prefix are on disk
    got = run(b, [longer])
    own = LLM(str(loud_k3), **{**KW, "calculate_kv_scales": True})  # B's scales, no tier
    run(own, [toks(9, 32)])
    assert run(own, [longer]) == got
    assert b.engine.tiers.index.stats["disk"].hits == 0
    a.engine.shutdown(), b.engine.shutdown()
    saved = json.loads((next((tmp_path / "tier").glob("*/kv_scales.json"))).read_text())
    assert {int(k): v for k, v in saved.items()} == sa  # the first writer's, not overwritten
    c = LLM(str(loud_k3), **kw)  # adopts A's scales, and so reads A's entries
    like_a = LLM(str(loud_k3), **{**KW, "calculate_kv_scales": True})
    run(like_a, [toks(48, 31)])
    assert run(c, [longer]) == run(like_a, [longer])
    assert c.engine.tiers.index.stats["disk"].hits > 0


def test_an_unwritable_directory_with_calibrated_scales_turns_the_disk_tier_off(tiny_k3_dir, tmp_path, caplog):
    """Issue 63 item 3: saving the scales failed inside every step that added cache entries (each
    such request failed). Now the disk tier is off with one warning; host memory still serves."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")  # root ignores file modes: a file in the path fails for it too
    kw = {**KW, "calculate_kv_scales": True, "kv_offloading_dir": str(blocker / "tier"), "kv_offloading_size": 0.05}
    prompts = [toks(40, 41), toks(40, 41) + toks(6, 42), toks(33, 43)]
    with caplog.at_level("WARNING", logger="k3serve.offload"):
        llm = LLM(str(tiny_k3_dir), **kw)
        got = [run(llm, [p])[0] for p in prompts]
    ref = LLM(str(tiny_k3_dir), **{**KW, "calculate_kv_scales": True})
    assert got == [run(ref, [p])[0] for p in prompts]
    assert llm.engine.tiers.index.disk is None
    warned = [r.getMessage() for r in caplog.records if r.name == "k3serve.offload"]
    assert len(warned) == 1 and "cannot be written" in warned[0] and str(blocker) in warned[0]
