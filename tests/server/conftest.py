"""A live k3serve server on 127.0.0.1 (random port, tiny K3, in a thread) for the openai client."""

from __future__ import annotations

import pytest

from k3serve.cli import build_parser
from k3serve.server.launch import build_server
from tests.live import serving

FLAGS = [
    "--cache-memory",
    "32MiB",
    "--max-model-len",
    "1024",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "kimi_k3",
    "--reasoning-parser",
    "kimi_k3",
    "--served-model-name",
    "tiny-k3",
]


def make_app(model_dir, *extra: str):
    return build_server(build_parser().parse_args(["serve", str(model_dir), *FLAGS, *extra]))


@pytest.fixture(scope="session")
def live_server(tiny_k3_dir):
    app, state = make_app(tiny_k3_dir)
    with serving(app, start_timeout=30) as base:
        yield base, state


@pytest.fixture(scope="session")
def client(live_server):
    from openai import OpenAI

    return OpenAI(base_url=live_server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)
