"""Prompt logprobs: `echo` + `logprobs` on completions return the prompt's logprobs (first token
null) equal to the model's own log-softmax at each position, computed independently: one full
forward of our model outside the engine (K3, while the engine prefills in 64-token chunks and
the prefix cache is warm), and transformers' native kimi_linear (Kimi-Linear). vLLM's
`prompt_logprobs` field on completions and chat; streaming echo carries them too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import torch

from k3serve.models.registry import load_model
from k3serve.forward import CacheTensors, ForwardBatch
from tests.live import serving
from tests.server.conftest import make_app

IDS = [int(x) for x in torch.randint(3, 500, (150,), generator=torch.Generator().manual_seed(5))]


def full_forward_logsoftmax(model_dir, ids: list[int]) -> torch.Tensor:
    """[len, vocab] log-softmax of one unchunked forward: the reference."""
    model = load_model(model_dir, progress=False)
    cache = CacheTensors.allocate(model.cfg, 1, 16, 16)
    batch = ForwardBatch(torch.tensor(ids), [len(ids)], [0], [0], [list(range(16))], 16)
    with torch.no_grad():
        return torch.log_softmax(model.compute_logits(model(batch, cache).hidden).float(), -1)


def _check_echo(body: dict, ref: torch.Tensor, ids: list[int], tol: float) -> None:
    lp = body["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["token_logprobs"]) == len(ids) + 1  # the prompt, then the one generated token
    want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    got = lp["token_logprobs"][1 : len(ids)]
    assert max(abs(a - b) for a, b in zip(got, want)) < tol
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_echo_logprobs_equal_a_full_forward_k3(tiny_k3_dir):
    ref = full_forward_logsoftmax(tiny_k3_dir, IDS)
    app, _ = make_app(tiny_k3_dir, "--max-num-batched-tokens", "64")
    body = {"prompt": IDS, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    with serving(app) as base:
        warm = httpx.post(base + "/v1/completions", timeout=60, json={"prompt": IDS, "max_tokens": 1})
        assert warm.status_code == 200  # the prompt's blocks and checkpoints are now cached
        r = httpx.post(base + "/v1/completions", timeout=60, json=body)
        assert r.status_code == 200, r.text
        _check_echo(r.json(), ref, IDS, 1e-4)
        # vLLM's prompt_logprobs field, ranks included
        r = httpx.post(
            base + "/v1/completions", timeout=60, json={"prompt": IDS, "max_tokens": 1, "prompt_logprobs": 3}
        )
        plp = r.json()["choices"][0]["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(IDS)
        for i in (1, 70, 149):
            entry = plp[i]
            own = entry[str(IDS[i])]
            assert abs(own["logprob"] - ref[i - 1, IDS[i]].item()) < 1e-4
            assert own["rank"] == int((ref[i - 1] > ref[i - 1, IDS[i]]).sum()) + 1
            top = sorted((v["rank"], int(k)) for k, v in entry.items() if v["rank"] <= 3)
            assert [k for _, k in top] == ref[i - 1].topk(3).indices.tolist()
        chat = httpx.post(
            base + "/v1/chat/completions",
            timeout=60,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0},
        )
        assert chat.status_code == 200 and chat.json()["prompt_logprobs"][0] is None
        assert all(len(e) == 1 for e in chat.json()["prompt_logprobs"][1:])
        bad = httpx.post(
            base + "/v1/chat/completions",
            timeout=60,
            json={"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1, "stream": True},
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"
        with httpx.stream("POST", base + "/v1/completions", timeout=60, json={**body, "stream": True}) as s:
            events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
        first = events[0]["choices"][0]
        assert first["logprobs"]["token_logprobs"][0] is None and len(first["logprobs"]["tokens"]) == len(IDS)
        assert abs(first["logprobs"]["token_logprobs"][5] - ref[4, IDS[5]].item()) < 1e-4


def test_echo_logprobs_equal_transformers_kimi_linear(tiny_kl_dir):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs=1, max_tokens=1, token ids)
    against transformers' own kimi_linear."""
    ids = IDS[:60]
    script = Path(__file__).parents[1] / "model" / "hf_reference.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(tiny_kl_dir), json.dumps(ids), "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = torch.log_softmax(torch.tensor(json.loads(proc.stdout.strip().splitlines()[-1])["logits"]), -1)
    app, _ = make_app(tiny_kl_dir)
    with serving(app) as base:
        r = httpx.post(
            base + "/v1/completions",
            timeout=60,
            json={"prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True},
        )
    assert r.status_code == 200, r.text
    _check_echo(r.json(), ref, ids, 1e-3)
