"""Hugging Face repo ids as model sources (issue 50, weights/hub.py), against a local hub over
real HTTP (k3serve/testing/hub_mirror.py) and a hub cache the test lays out itself: only the
files the engine reads are fetched (not a large extra file, a README or a GGUF beside them), a
cached snapshot serves with no request at all and offline, an offline miss, an unknown repo and
a non-K3 repo fail fast naming the repo, and `plan` / `inspect` fetch config.json alone."""

from __future__ import annotations

import json
import shutil

import pytest

from k3serve import LLM, SamplingParams
from k3serve.testing.hub_mirror import HubMirror
from k3serve.weights.hub import ModelSourceError, resolve_model

REPO = "moonshotai/Tiny-K3"
KW = dict(kernels="torch", cache_memory="16MiB", max_model_len=128)


@pytest.fixture()
def hub(tiny_k3_dir, tmp_path, monkeypatch):
    root = tmp_path / "repo"
    shutil.copytree(tiny_k3_dir, root)
    (root / "original").mkdir()
    (root / "original" / "consolidated.bin").write_bytes(b"\0" * (4 << 20))  # must never be fetched
    (root / "README.md").write_text("# tiny")
    (root / "model-q4.gguf").write_bytes(b"GGUF" * 1000)
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    (other / "model.safetensors").write_bytes(b"\0" * 1024)
    mirror = HubMirror({REPO: root, "meta/llama-tiny": other})
    monkeypatch.setenv("HF_ENDPOINT", mirror.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the suite's default (tests/conftest.py)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read once, at its import
    yield mirror, tmp_path / "cache"
    mirror.close()


def test_a_repo_id_serves_and_fetches_only_what_the_engine_reads(hub, tiny_k3_dir, monkeypatch):
    mirror, cache = hub
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(str(tiny_k3_dir), **KW).generate("The fox", sp)[0].outputs[0].token_ids
    llm = LLM(REPO, download_dir=str(cache), **KW)
    assert llm.generate("The fox", sp)[0].outputs[0].token_ids == want
    got = mirror.fetched()
    index = json.loads((tiny_k3_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) <= got and "config.json" in got and "tiktoken.model" in got
    assert not {"original/consolidated.bin", "README.md", "model-q4.gguf"} & got
    # cached: the same snapshot with no request, online or offline
    mirror.log.clear()
    path = resolve_model(REPO, download_dir=str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model(REPO, download_dir=str(cache)) == path == llm.engine.model_path
    assert mirror.log == []
    # /v1/models `root`: the repo id (a tokenizer-driven client loads it); a local folder: nothing
    assert llm.engine.info().model_source == REPO
    assert LLM(str(tiny_k3_dir), **KW).engine.info().model_source == ""


def test_offline_without_a_cache_unknown_and_foreign_repos_fail_fast(hub, monkeypatch):
    mirror, cache = hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError, match=f"{REPO}.*HF_HUB_OFFLINE"):
        resolve_model(REPO, download_dir=str(cache))
    assert mirror.log == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(ModelSourceError, match="nobody/nothing.*no such repository"):
        resolve_model("nobody/nothing", download_dir=str(cache))
    with pytest.raises(ModelSourceError, match="'llama' model"):
        resolve_model("meta/llama-tiny", download_dir=str(cache))
    assert "model.safetensors" not in mirror.fetched()  # refused on its config, before the weights
    with pytest.raises(ModelSourceError, match="not a Hugging Face repo id"):
        resolve_model("./no/such/dir/here")


def test_plan_and_inspect_read_a_repo_config_alone(hub, monkeypatch, capsys):
    from k3serve.cli import main

    mirror, cache = hub
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert main(["inspect", REPO, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == REPO
    assert mirror.fetched() == {"config.json"}


def test_bench_tokenizer_from_a_repo_id_fetches_the_tokenizer_alone(hub, tiny_k3_dir, monkeypatch):
    """`k3serve bench --tokenizer ORG/NAME` counts and decodes with the repo's tokenizer files only."""
    from k3serve.bench.datasets import BenchRequest
    from k3serve.bench.text_datasets import as_text, token_counter
    from k3serve.tokenizer.tokenizer import Tokenizer

    mirror, cache = hub
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    want = Tokenizer.from_dir(tiny_k3_dir)
    count = token_counter(REPO, "http://127.0.0.1:9", None)  # no server: the repo's tokenizer counts
    assert count("The quick brown fox") == len(want.encode("The quick brown fox"))
    (req,) = as_text([BenchRequest(want.encode("hello there"), None, 4)], REPO, "http://127.0.0.1:9", None)
    ids = want.encode("hello there")
    assert req.prompt == want.decode(ids) and req.prompt_tokens == len(ids) and req.prompt_token_ids is None
    assert mirror.fetched() <= {"tokenizer_config.json", "tiktoken.model", "tokenizer.json", "special_tokens_map.json"}
    assert "tiktoken.model" in mirror.fetched()
