"""The shared-memory collectives (kernels/cpu/comm/shm_comm.cpp via parallel/shm.py), two ranks as
threads: sums in rank order with an fp32 accumulator (the same bits on every rank), gathers in
rank order, many rounds through both buffers, and a clear error for a peer that is gone."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from k3serve import kernels
from k3serve.parallel.shm import ShmComm, create_segment

K = kernels.get("auto")
pytestmark = pytest.mark.skipif(K is None, reason="the CPU kernels did not build")


def _pair(fn, world=2):
    path = create_segment(world, slot_bytes=1 << 16)
    comms = [ShmComm(path, r, world, K, timeout_s=30, slot_bytes=1 << 16) for r in range(world)]
    Path(path).unlink()
    out, errors = [None] * world, []

    def run(r):
        try:
            out[r] = fn(comms[r], r)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_reduce_is_the_rank_order_sum_on_every_rank(dtype):
    inputs = [
        [torch.randn(3, 37, generator=torch.Generator().manual_seed(10 * step + r)).to(dtype) for r in range(2)]
        for step in range(50)
    ]  # 50 rounds: both buffers, reused

    def work(comm, r):
        return [comm.all_reduce(inputs[s][r].clone()) for s in range(50)]

    a, b = _pair(work)
    for s in range(50):
        want = (inputs[s][0].float() + inputs[s][1].float()).to(dtype)
        assert torch.equal(a[s], want) and torch.equal(b[s], want)


def test_all_gather_concatenates_in_rank_order():
    def work(comm, r):
        return comm.all_gather(torch.full((2, 3), float(r)))

    for got in _pair(work):
        assert torch.equal(got, torch.cat([torch.zeros(2, 3), torch.ones(2, 3)], -1))


def test_a_tensor_over_the_slot_does_not_fit():
    path = create_segment(2, slot_bytes=1 << 10)
    comm = ShmComm(path, 0, 2, K, timeout_s=1, slot_bytes=1 << 10)
    Path(path).unlink()
    assert comm.fits(torch.zeros(256)) and not comm.fits(torch.zeros(257))
    assert not comm.fits(torch.zeros(4, dtype=torch.float64))


def test_a_peer_that_is_gone_fails_fast():
    path = create_segment(2, slot_bytes=1 << 10)
    comm = ShmComm(path, 0, 2, K, timeout_s=60, slot_bytes=1 << 10)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    seg = torch.from_file(path, shared=True, size=comm.seg.numel(), dtype=torch.uint8)
    seg[64 + 8 : 64 + 16] = torch.tensor([dead.pid], dtype=torch.int64).view(torch.uint8)  # rank 1's pid line
    Path(path).unlink()
    with pytest.raises(RuntimeError, match="rank 1 .* is gone"):
        comm.all_reduce(torch.ones(4))


def test_a_silent_peer_times_out():
    path = create_segment(2, slot_bytes=1 << 10)
    comm = ShmComm(path, 0, 2, K, timeout_s=0.5, slot_bytes=1 << 10)
    Path(path).unlink()
    with pytest.raises(RuntimeError, match="timed out after 0.5 s waiting for rank 1"):
        comm.all_reduce(torch.ones(4))


def test_reduce_scatter_leaves_each_rank_its_chunk_of_the_rank_order_sum():
    xs = [torch.randn(6, 5, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    got = _pair(lambda comm, r: [comm.reduce_scatter(xs[r].clone()) for _ in range(3)], world=3)
    want = ((xs[0] + xs[1]) + xs[2]).view(3, 2, 5)
    for r in range(3):
        assert all(torch.equal(g, want[r]) for g in got[r])


def test_all_to_all_takes_each_ranks_rows_for_this_one_in_source_order():
    """Three ranks, ragged counts with zeros (rank 1 sends nothing; nobody sends rank 2 rows
    from rank 0), rows of raw bytes: rank r's rows for d are full of 10 * r + d."""
    counts = [2, 1, 0, 0, 0, 0, 3, 1, 2]  # [src * 3 + dst]

    def rows(r):
        parts = [torch.full((counts[r * 3 + d], 4), 10 * r + d, dtype=torch.uint8) for d in range(3)]
        return torch.cat(parts)

    got = _pair(lambda comm, r: [comm.all_to_all(rows(r), counts) for _ in range(3)], world=3)
    for d in range(3):
        want = torch.cat([torch.full((counts[r * 3 + d], 4), 10 * r + d, dtype=torch.uint8) for r in range(3)])
        assert all(torch.equal(g, want) for g in got[d])


def test_all_to_all_refuses_rows_that_disagree_with_the_counts():
    with pytest.raises(RuntimeError, match="3 rows, but the counts send 2"):
        _pair(lambda comm, r: comm.all_to_all(torch.zeros(3, 4), [1, 1, 1, 1]))
