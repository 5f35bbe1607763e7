"""Shared fixtures: tiny checkpoints in the real layouts, built once per session."""

from __future__ import annotations

import os

import pytest
import torch

# The Triton kernels (tests/kernels, kernels="triton" engines) run under Triton's interpreter on
# a CPU. It is read when a kernel is decorated, so it is set before anything imports one; a GPU
# run (bench/gpu_check.sh) compiles them for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from k3serve.testing.builder import build_tiny_checkpoint


@pytest.fixture(autouse=True, scope="session")
def _fla_under_the_interpreter():
    """The triton backend's prefill runs fla's chunk_kda, which needs two patches under Triton's
    interpreter (tests/fla_interpreter.py): applied when a test first builds that backend."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from k3serve.backends import triton as backend

    init = backend.TritonBackend.__init__

    def patched(self, *args, **kwargs):
        from tests.fla_interpreter import apply

        apply()
        init(self, *args, **kwargs)

    backend.TritonBackend.__init__ = patched
    yield
    backend.TritonBackend.__init__ = init


@pytest.fixture(autouse=True)
def _compiles_end_with_their_test():
    """A graph bucket one test queued finishes compiling before the next test starts: a compile
    thread outlives its engine, and one still tracing while the next test called
    torch._dynamo.reset() killed the suite's process (SIGFPE, a loaded machine)."""
    yield
    import sys

    steps = sys.modules.get("k3serve.runner.compile_thread")
    if steps is not None:
        assert steps.wait_for_compiles(600), "a graph bucket still compiling 10 minutes after its test"


@pytest.fixture(autouse=True)
def _no_hub_downloads(monkeypatch):
    """Nothing in the suite reaches the Hugging Face Hub: a repo id resolves from a cache or fails
    fast (weights/hub.py reads the variable per call); tests/unit/test_hub.py serves its own hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_k3_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_k3"), kind="k3", seed=0)


@pytest.fixture(scope="session")
def tiny_kl_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_kl"), kind="kimi_linear", seed=0)


@pytest.fixture(scope="session")
def random_dspark(tiny_k3_dir, tmp_path_factory):
    """An untrained DSpark drafter for tiny K3 (tap layers 1, 4, 6; blocks of 4)."""
    import torch

    from k3serve.config.bundled import load_model_config
    from k3serve.spec_decode.dspark import DSparkConfig, DSparkModel, save_dspark

    cfg = load_model_config(tiny_k3_dir)
    torch.manual_seed(0)
    model = DSparkModel(DSparkConfig((1, 4, 6), 4, cfg.pad_token_id, cfg.vocab_size, cfg.hidden_size, markov_rank=8))
    return str(save_dspark(model, tmp_path_factory.mktemp("dspark")))


def pytest_configure(config):
    """bench/gpu_check.sh's overrides for the suites it runs on a GPU:
    K3SERVE_TEST_DTYPE=float32: engines asked for dtype "auto" take it instead of the device's
    default (bf16 on a GPU), so that the suites' exact-equality assertions mean on a GPU what
    they mean on a CPU; K3SERVE_TEST_KERNELS=torch: engines asked for kernels "auto" take it
    (on a GPU "auto" is the graph backend, which compiles every bucket it meets)."""
    import os

    dtype, kernels = os.environ.get("K3SERVE_TEST_DTYPE"), os.environ.get("K3SERVE_TEST_KERNELS")
    if not (dtype or kernels):  # import nothing of the engine at configure time otherwise (the Ray
        return  # test's cluster then timed out the next TP server's rendezvous)
    import dataclasses

    from k3serve.engine import build

    if dtype:

        def placement(cfg, _orig=build.placement):
            return _orig(dataclasses.replace(cfg, dtype=dtype) if cfg.dtype == "auto" else cfg)

        build.placement = placement
    if kernels:

        def resolve_backend(cfg, device, _orig=build.resolve_backend):
            return _orig(dataclasses.replace(cfg, kernels=kernels) if cfg.kernels == "auto" else cfg, device)

        build.resolve_backend = resolve_backend
