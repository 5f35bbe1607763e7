"""The expert group's reduce-scatter and all-to-all (parallel/group.py), three ranks as threads:
over gloo, over the shared segment, and over a segment too small for the rows (which must take
gloo on every rank, by the same choice): the same rows everywhere, and the payload counted is
only what leaves each rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3serve import kernels
from k3serve.parallel.expert_group import in_threads, thread_process_groups
from k3serve.parallel.group import TPGroup
from k3serve.parallel.shm import ShmComm, create_segment

K = kernels.get("auto")
SEND = [[2, 1, 0], [0, 0, 0], [3, 1, 2]]  # rows rank r sends rank d: ragged, with idle pairs


def groups(transport: str) -> list[TPGroup]:
    pgs = thread_process_groups(3, 60)
    shms = [None] * 3
    if transport != "gloo":
        if K is None:
            pytest.skip("the CPU kernels did not build")
        slot = 1 << 16 if transport == "shm" else 64  # 64 B: rank 2's 6 rows of 48 B don't fit
        path = create_segment(3, slot_bytes=slot)
        shms = [ShmComm(path, r, 3, K, timeout_s=30, slot_bytes=slot) for r in range(3)]
        Path(path).unlink()
    return [TPGroup(r, 3, True, pgs[r], shms[r]) for r in range(3)]


def on_ranks(gs: list[TPGroup], fn) -> list:
    out = [None] * 3
    assert in_threads(3, lambda r: out.__setitem__(r, fn(gs[r])), 60)
    return out


def rows(src: int, dst: int, n: int) -> torch.Tensor:
    return torch.arange(n * 3, dtype=torch.float32).view(n, 3) + 100 * src + 10 * dst


@pytest.mark.parametrize("transport", ["gloo", "shm", "shm-too-small"])
def test_all_to_all_delivers_every_ranks_rows_in_source_order(transport):
    gs = groups(transport)

    def work(g):
        counts = g.row_counts(SEND[g.rank])
        x = torch.cat([rows(g.rank, d, n) for d, n in enumerate(SEND[g.rank])])
        return counts, g.all_to_all(x, counts), g.stats.bytes.get("all_to_all", 0)

    for d, (counts, got, sent) in enumerate(on_ranks(gs, work)):
        assert counts == [n for per in SEND for n in per]
        assert torch.equal(got, torch.cat([rows(s, d, SEND[s][d]) for s in range(3)]))
        assert sent == sum(n for e, n in enumerate(SEND[d]) if e != d) * 3 * 4  # off-rank rows only


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_reduce_scatter_returns_this_ranks_chunk_of_the_sum(transport):
    gs = groups(transport)
    xs = [torch.randn(6, 2, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    got = on_ranks(gs, lambda g: g.reduce_scatter(xs[g.rank].clone()))
    want = (xs[0] + xs[1] + xs[2]).view(3, 2, 2)
    for r in range(3):
        torch.testing.assert_close(got[r], want[r], rtol=0, atol=1e-6)
