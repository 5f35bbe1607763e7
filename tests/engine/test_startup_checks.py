"""Start-up refuses or states what would otherwise fail later (issue 18 item 7): NaN/Inf weights,
a tokenizer that covers less than the model's vocabulary, fewer slots than --max-num-seqs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3serve import LLM, SamplingParams
from k3serve.weights.errors import NonFiniteWeightError

KW = dict(cache_memory="32MiB", max_model_len=256)


def _poison(ckpt, pick, value) -> tuple[str, str]:
    """Overwrite the first tensor `pick(name)` selects with `value`; (tensor, file)."""
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    name = next(n for n in sorted(index) if pick(n))
    path = ckpt / index[name]
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    t = tensors[name].clone()
    t.view(-1)[t.numel() // 2] = value
    tensors[name] = t
    save_file(tensors, str(path), metadata=meta)
    return name, index[name]


@pytest.mark.parametrize(
    "pick, value",
    [
        (lambda n: n.endswith("q_proj.weight") or n.endswith("q_a_proj.weight"), float("nan")),
        (lambda n: n.endswith("lm_head.weight"), float("inf")),
        (lambda n: n.endswith(".weight_scale"), 0xFF),  # the E8M0 NaN code of an MXFP4 block scale
    ],
    ids=["nan", "inf", "mxfp4-scale"],
)
def test_non_finite_weights_stop_start_up_naming_tensor_and_file(tiny_k3_dir, tmp_path, pick, value):
    ckpt = shutil.copytree(tiny_k3_dir, tmp_path / "ckpt")
    name, file = _poison(ckpt, pick, value)
    with pytest.raises(NonFiniteWeightError) as e:
        LLM(str(ckpt), **KW)
    assert name in str(e.value) and file in str(e.value)


def test_a_short_tokenizer_is_masked_and_stated(tiny_k3_dir, tmp_path):
    ckpt = shutil.copytree(tiny_k3_dir, tmp_path / "ckpt")
    ranks = (ckpt / "tiktoken.model").read_text().splitlines()
    (ckpt / "tiktoken.model").write_text("\n".join(ranks[:-12]) + "\n")  # 12 ids lose their text
    llm = LLM(str(ckpt), **KW)
    eng = llm.engine
    gap = list(range(len(ranks) - 12, len(ranks)))
    assert eng.unmapped_ids == gap
    assert any("masked out of sampling" in line for line in eng.startup_log)
    # even pushed with the largest bias, an unmapped id is never sampled (its text would not exist)
    bias = {t: 100.0 for t in gap}
    out = llm.generate(
        {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias=bias)
    )[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 8
    assert not set(out.outputs[0].token_ids) & set(gap)
    with pytest.raises(ValueError, match="has no text"):
        eng.add_request("p", {"prompt_token_ids": [5, gap[0]]})


def test_slots_match_max_num_seqs_or_the_log_says_why(tiny_k3_dir):
    llm = LLM(str(tiny_k3_dir), max_model_len=256, max_num_seqs=4)  # default cache budget, prefix caching on
    assert llm.engine.plan.num_slots == 4 and llm.engine.seq_limit_note is None
    small = LLM(str(tiny_k3_dir), max_model_len=256, max_num_seqs=64, cache_memory="600KiB")
    note = small.engine.seq_limit_note
    assert small.engine.plan.num_slots < 64 and note and "--max-num-seqs 64" in note
    assert note in small.engine.startup_log
    assert torch.get_default_dtype() == torch.float32  # nothing above changed global torch state
