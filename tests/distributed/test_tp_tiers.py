"""Prefix-cache tiers under tensor parallelism (issue 49): a state entry holds every rank's KDA
heads (`recurrent.{l}` rank 0's, `recurrent.{l}.r1` rank 1's), a block entry the latent rows
every rank holds whole; a restarted TP2 engine on the same directory loads the prefix into both
ranks and decodes the tokens of a cold single-process recompute."""

from __future__ import annotations

import torch
from safetensors import safe_open

from k3serve import LLM, SamplingParams

KW = dict(cache_memory="32MiB", max_model_len=512, block_size=16, seed=0)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def toks(n: int, seed: int) -> list[int]:
    return torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(llm, prompt):
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_tp2_tiers_keep_every_ranks_heads_across_a_restart(tiny_kl_dir, tmp_path):
    path, disk = str(tiny_kl_dir), str(tmp_path / "tiers")
    prefix, suffix = toks(80, 41), toks(7, 42)
    want, _ = run(LLM(path, **KW, enable_prefix_caching=False), prefix + suffix)
    first = LLM(path, tensor_parallel_size=2, kv_offloading_dir=disk, **KW)
    try:
        run(first, prefix)
    finally:
        first.engine.shutdown()  # its queued writes reach the directory
    states = list((tmp_path / "tiers").glob("*/state/*/*.safetensors"))
    assert states
    with safe_open(str(states[0]), "pt") as f:
        names = {n.split(".", 1)[1] for n in f.keys()}  # "{key hex}.{name}"
    kda = [n for n in names if n.startswith("recurrent.") and n.count(".") == 1]
    assert kda and all(f"{n}.r1" in names for n in kda)  # rank 1's heads beside rank 0's
    again = LLM(path, tensor_parallel_size=2, kv_offloading_dir=disk, **KW)
    try:
        got, cached = run(again, prefix + suffix)
        assert cached == 80 and got == want
        assert again.engine.tiers.index.stats["disk"].hits >= 6
    finally:
        again.engine.shutdown()
