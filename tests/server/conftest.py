"""A live k3serve server on 127.0.0.1 (random port, tiny K3, in a thread) for the openai client."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn

from k3serve.cli import build_parser
from k3serve.server.launch import build_server

FLAGS = ["--cache-memory", "32MiB", "--max-model-len", "1024", "--enable-auto-tool-choice",
         "--tool-call-parser", "kimi_k3", "--reasoning-parser", "kimi_k3", "--served-model-name", "tiny-k3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_app(model_dir, *extra: str):
    return build_server(build_parser().parse_args(["serve", str(model_dir), *FLAGS, *extra]))


@pytest.fixture(scope="session")
def live_server(tiny_k3_dir):
    app, state = make_app(tiny_k3_dir)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="session")
def client(live_server):
    from openai import OpenAI
    return OpenAI(base_url=live_server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)
