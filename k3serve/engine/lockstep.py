"""DP-attention + expert parallelism: M engine replicas that step together (issue 16).

Each replica has its own scheduler, cache and whole attention, and its model holds 1/M of the
routed experts (an expert group, parallel/expert_group.py); every MoE layer gathers all the
replicas' tokens (layers/moe.py `_dp_ep_forward`). So every replica must run a forward each
step, in the same order: one loop here steps all of them at once, each on its own engine thread,
and a replica with nothing scheduled runs an idle forward (its MoE layers' collectives, no
tokens). When no replica has work the loop sleeps; a new request or abort on any replica wakes it.
A replica whose forward raises halfway leaves its peers waiting in a collective until the group's
timeout, after which the group is broken for good (as a dead TP worker breaks a TP group).
Reference: vLLM v1 DP engine cores (dummy batches for idle ranks, `_has_global_unfinished_reqs`).
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("k3serve.engine")


class Lockstep:
    def __init__(self, replicas: list):
        self.replicas = replicas  # AsyncEngine, one per data-parallel rank (rank = index)
        self.wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        for r in replicas:
            r.lockstep = self

    def ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self.wakeup = asyncio.Event()
            for r in self.replicas:
                r.share_wakeup(self.wakeup)  # a replica's generate/abort wakes the shared loop
            self._task = asyncio.get_running_loop().create_task(self._run(), name="k3serve-lockstep-loop")

    async def _run(self) -> None:
        try:
            while True:
                if not any(r.has_work() for r in self.replicas):
                    self.wakeup.clear()
                    await self.wakeup.wait()
                # every replica steps, idle ones included (their MoE collectives); each delivers
                # its own outputs or fails its own requests (AsyncEngine.step_once)
                results = await asyncio.gather(
                    *(r.step_once(always=True) for r in self.replicas), return_exceptions=True
                )
                for res in results:
                    if isinstance(res, BaseException):  # only a cancellation gets past step_once
                        raise res
        except BaseException as e:  # cancelled at shutdown, or a fault outside any step
            for r in self.replicas:
                r.stopped(e)
            raise

    async def shutdown(self) -> None:
        from k3serve.engine.async_engine import cancel

        await cancel(self._task)
