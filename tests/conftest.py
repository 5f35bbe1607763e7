"""Shared fixtures: tiny checkpoints in the real layouts, built once per session."""

from __future__ import annotations

import pytest

from k3serve.testing.builder import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_k3_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_k3"), kind="k3", seed=0)


@pytest.fixture(scope="session")
def tiny_kl_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_kl"), kind="kimi_linear", seed=0)
