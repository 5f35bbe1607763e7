"""Engines on the tiny checkpoints, built once per module where they are cheap to share."""

from __future__ import annotations

import pytest

from k3serve import LLM

ENGINE_KW = dict(cache_memory="32MiB", max_model_len=512, max_num_batched_tokens=96, seed=0)


@pytest.fixture(scope="session")
def k3_llm(tiny_k3_dir):
    return LLM(str(tiny_k3_dir), **ENGINE_KW)


@pytest.fixture(scope="session")
def kl_llm(tiny_kl_dir):
    return LLM(str(tiny_kl_dir), **ENGINE_KW)
