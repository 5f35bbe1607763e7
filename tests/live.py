"""Run an ASGI app under uvicorn in a daemon thread on a free 127.0.0.1 port (live-server tests)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from k3serve.server.http import uvicorn_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(app, start_timeout: float = 60.0, **http) -> Iterator[str]:
    """Yield the base URL once the server accepts connections; stop it on exit. `http` goes to
    `uvicorn_config` (the protocol and timeouts `k3serve serve` runs with)."""
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, log_level="warning", **http))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def metric(base: str, name: str) -> float:
    """One unlabelled sample of the server's /metrics."""
    import httpx

    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)
