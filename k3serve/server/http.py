"""uvicorn with read timeouts: the HTTP/1.1 protocol k3serve serves on.

uvicorn's h11 protocol times out only idle keep-alive connections (`timeout_keep_alive`); a
client that opens a socket and sends half a request line, or trickles headers, holds it
forever (issue 18: 300 such connections held 60 s, none closed). `guarded_h11` adds a
header deadline: from connection start, or from the first byte after a response, the request
head must be complete within `header_timeout` seconds or the socket is closed. Body reads are
timed by the guard middleware (408). Reference: uvicorn `protocols/http/h11_impl.py`.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


def guarded_h11(header_timeout: float) -> type[H11Protocol]:
    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if (self.cycle is None or self.cycle.response_complete) and self._head_timer is None:
                self._arm()  # the first bytes of a next request on a kept-alive connection
            before = self.cycle
            super().data_received(data)
            if self.cycle is not before:  # a request head arrived: the app has it now
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.cycle is None or self.cycle.response_complete:
                self.transport.close()

    return GuardedH11Protocol


def draining_server(config, lifecycle, grace_s: float):
    """uvicorn.Server that drains before it shuts down (the `--shutdown-timeout N` contract).

    First SIGTERM / SIGINT: `lifecycle.draining` is set, so the guard answers new requests 503
    while the listener stays open (a load balancer sees an answer, not a refused connection);
    once the in-flight requests are done, or `grace_s` has passed, uvicorn's own shutdown runs
    and cancels what is left (the guard answers those 503). `grace_s` 0 aborts at once; a
    second SIGINT forces the exit.
    """
    import time

    import uvicorn

    class DrainingServer(uvicorn.Server):
        deadline: float | None = None

        def handle_exit(self, sig, frame) -> None:
            if self.deadline is None and grace_s > 0:
                self._captured_signals.append(sig)
                self.deadline = time.monotonic() + grace_s
                lifecycle.draining = True
                return
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if self.deadline is not None and (lifecycle.active == 0 or time.monotonic() >= self.deadline):
                self.should_exit = True
            return await super().on_tick(counter)

    return DrainingServer(config)


def uvicorn_config(
    app,
    host: str,
    port: int,
    *,
    log_level: str = "info",
    header_timeout: float = 10.0,
    keep_alive_timeout: int = 5,
    graceful_shutdown_timeout: int | None = 10,
):
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=guarded_h11(header_timeout),
        timeout_keep_alive=keep_alive_timeout,
        timeout_graceful_shutdown=graceful_shutdown_timeout,
    )
