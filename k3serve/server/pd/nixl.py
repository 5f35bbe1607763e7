"""NIXL transport for prefill/decode hand-offs (issue 17): the decode server READs a request's
hand-off straight out of the prefill server's memory through NVIDIA NIXL (UCX underneath:
shared memory between processes on one host, TCP or RDMA between hosts), as vLLM's
NixlConnector reads KV blocks.

  decode -> prefill  POST /v1/kv/pull {"request_id", "held_tokens", "transport": "nixl"}
  prefill            writes the hand-off (engine/handoff.py wire format, only the rows past
                     held_tokens) into a buffer, registers it with its agent and answers
                     {"agent_metadata", "addr", "nbytes", "notif"} as JSON: no tensor bytes on HTTP
  decode             adds (updates) the prefill agent from that metadata, READs `nbytes` into a buffer it
                     registered; the READ delivers `notif` to the prefill agent, which then drops
                     the buffer (an unread one goes after `ttl_s`).

References: vLLM distributed/kv_transfer/kv_connector/v1/nixl_connector.py (metadata over a side
channel, READ by the decode side, a notification to free); NIXL's python API (nixl._api).
Install: `pip install -e '.[nixl]'` (nixl and its CUDA-12 build, which runs on a CPU-only host).
"""

from __future__ import annotations

import base64
import logging
import threading
import time
import uuid
from dataclasses import dataclass

import torch

log = logging.getLogger("k3serve.kv_nixl")
NOTIF = "k3serve-read:"


@dataclass
class _Lent:
    buffer: torch.Tensor  # [nbytes] uint8, registered with the agent
    reg: object  # its nixlRegDList, for deregistering
    deadline: float


class NixlTransport:
    """One NIXL agent per server (UCX backend, DRAM): lends hand-offs (prefill) and reads them (decode)."""

    def __init__(self, ttl_s: float = 60.0, poll_s: float = 0.002):
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError:
            raise ValueError(
                "kv_connector NixlConnector needs NIXL: pip install 'k3serve[nixl]' (nixl==1.5.1 nixl-cu12==1.5.1)"
            ) from None
        self.name = f"k3serve-{uuid.uuid4().hex[:12]}"
        # no progress thread: NIXL's spins a whole core per agent even when idle (measured here:
        # 5.0 CPU s in 5 idle s), which on a shared host slows every engine beside it. Transfers
        # progress when polled instead: the reader polls its READ, and while a buffer is lent the
        # reclaimer polls notifications every `poll_s`, which also progresses the lender's side.
        self.agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        if "UCX" not in self.agent.backends:
            raise ValueError("NIXL found no UCX backend on this host; use kv_connector K3HttpConnector")
        self.ttl_s, self.poll_s = ttl_s, poll_s
        self.lent: dict[str, _Lent] = {}
        self._stuck: list = []  # reads that timed out while in flight (kept, never reused)
        self.lock = threading.Lock()  # the agent is called from the server's worker threads
        self._wake = threading.Event()
        threading.Thread(target=self._reclaimer, name="k3serve-nixl-reclaim", daemon=True).start()

    # ---- prefill side ---------------------------------------------------------------------
    def lend(self, request_id: str, data: bytes) -> dict:
        """Register one serialized hand-off for a decode agent to READ; the offer it needs."""
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        with self.lock:
            reg = self.agent.register_memory(buf)
            self.lent[request_id] = _Lent(buf, reg, time.monotonic() + self.ttl_s)
            metadata = self.agent.get_agent_metadata()  # now naming the new buffer
        self._wake.set()
        return {
            "agent_metadata": base64.b64encode(metadata).decode(),
            "addr": buf.data_ptr(),
            "nbytes": buf.numel(),
            "notif": NOTIF + request_id,
        }

    @property
    def lent_bytes(self) -> int:
        return sum(x.buffer.numel() for x in list(self.lent.values()))

    def reclaim(self) -> None:
        """Drop the buffers whose READ has finished (its notification came) or whose time is up."""
        with self.lock:
            done = {
                m.decode(errors="replace")[len(NOTIF) :]
                for msgs in self.agent.get_new_notifs().values()
                for m in msgs
                if m.startswith(NOTIF.encode())
            }
            now = time.monotonic()
            for rid in [r for r, x in self.lent.items() if r in done or x.deadline < now]:
                x = self.lent.pop(rid)
                if rid not in done:
                    log.warning("NIXL hand-off %s was never read; dropped after %.0f s", rid, self.ttl_s)
                self.agent.deregister_memory(x.reg)

    def _reclaimer(self) -> None:
        while True:
            if not self.lent:
                self._wake.wait()
                self._wake.clear()
            time.sleep(self.poll_s)
            try:
                self.reclaim()
            except Exception:  # a NIXL error must not end the thread that frees buffers
                log.exception("reclaiming NIXL hand-off buffers failed")

    # ---- decode side ----------------------------------------------------------------------
    def read(self, offer: dict, timeout_s: float = 60.0) -> bytes:
        """READ an offered hand-off from the prefill agent into local memory."""
        try:
            meta = base64.b64decode(offer["agent_metadata"])
            addr, nbytes, notif = int(offer["addr"]), int(offer["nbytes"]), str(offer["notif"]).encode()
        except (KeyError, TypeError, ValueError):
            raise ConnectionError("the prefill server's NIXL offer is malformed") from None
        dst = torch.empty(nbytes, dtype=torch.uint8)
        with self.lock:
            reg = self.agent.register_memory(dst)
            try:  # (re-)adding the agent updates what NIXL knows of its registered memory
                remote = self.agent.add_remote_agent(meta)
                handle = self.agent.initialize_xfer(
                    "READ",
                    self.agent.get_xfer_descs(dst),
                    self.agent.get_xfer_descs([(addr, nbytes, 0)], "DRAM"),
                    remote,
                    notif,
                )
                status = self.agent.transfer(handle)
            except Exception as e:  # nixl's own errors: the offer names memory this agent cannot reach
                self.agent.deregister_memory(reg)
                raise ConnectionError(f"NIXL could not start the read ({type(e).__name__}: {e})") from None
        try:
            deadline = time.monotonic() + timeout_s
            while status == "PROC" and time.monotonic() < deadline:
                time.sleep(0.0005)
                with self.lock:
                    status = self.agent.check_xfer_state(handle)
            if status != "DONE":
                raise ConnectionError(
                    f"the NIXL read of {nbytes} bytes "
                    + ("failed" if status == "ERR" else f"took over {timeout_s:.0f} s")
                )
        finally:
            with self.lock:
                if status == "PROC":  # still in flight after the timeout: its buffer must outlive it
                    self._stuck.append((handle, reg, dst))
                else:
                    self.agent.release_xfer_handle(handle)
                    self.agent.deregister_memory(reg)
        return dst.numpy().tobytes()
