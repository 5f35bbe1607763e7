"""One request's cache state read from and written to a replica's ranks, through its executor
(executor/base.py): its latent rows (whole on every rank) and its KDA state (each rank's heads).
What a prefill/decode hand-off carries between engines (engine/handoff.py).

Under tensor parallelism rank r holds heads [r*h, (r+1)*h) of every KDA layer: recurrent
[h, D, D]; conv [K-1, 3hD] laid out [q_r | k_r | v_r] (layers/kda.py), the whole one [q | k | v].
What is read carries every head (in checkpoint order), so a TP2 engine can hand to a TP1 or TP4
engine.
"""

from __future__ import annotations

import torch

from k3serve.forward.cache import from_cache, to_cache


def rows_of(
    table: list[int], start: int, end: int, block_size: int, device: torch.device | None = None
) -> torch.Tensor:
    """Latent-cache rows of positions [start, end) under a block table, on `device`: beside the
    cache they index."""
    pos = torch.arange(start, end)
    return (torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size).to(device)


def read_request(executor, table: list[int], start: int, end: int, block_size: int, slot: int):
    """(latent {layer: [end - start, c + r]}, recurrent and conv with every head, the fp8
    latent's per-layer scales or None) of positions [start, end) and state slot `slot`."""
    latent = executor.read_rows(rows_of(table, start, end, block_size))  # gathered: copies
    rec, conv = merge_heads(executor.read_state(slot))
    cache = executor.cache
    scales = None
    if cache is not None and cache.latent_scale is not None:
        scales = {i: float(s) for i, s in cache.latent_scale.items()}
    return latent, rec, conv, scales


def write_request(
    executor,
    table: list[int],
    start: int,
    end: int,
    block_size: int,
    slot: int,
    latent: dict,
    latent_scale: dict | None,
    recurrent: dict,
    conv: dict,
) -> None:
    """Rows [start, end) on every rank, re-encoded under this cache's fp8 scale where either
    side has one (a calibrating layer takes its scale from them, as from a prefill's rows), and
    each rank its heads of the state into `slot`."""
    cache = executor.cache
    if cache is not None and (latent_scale is not None or cache.latent_scale is not None):
        latent = dict(latent)
        for i, rows in latent.items():
            values = from_cache(rows.to(cache.device), None if latent_scale is None else latent_scale[i])
            latent[i] = to_cache(values, cache.latent[i].dtype, cache.observe(i, values))
    executor.write_rows(rows_of(table, start, end, block_size), latent)
    executor.write_state(slot, split_heads(recurrent, conv, executor.size))


def merge_heads(parts: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """Rank-ordered (recurrent, conv) per rank -> the whole state, every head."""
    rec = {i: torch.cat([p[0][i] for p in parts]) for i in parts[0][0]}
    conv = {}
    for i in parts[0][1]:
        thirds = [p[1][i].view(p[1][i].shape[0], 3, -1) for p in parts]  # [K-1, 3, hD] per rank
        conv[i] = torch.cat(thirds, -1).reshape(thirds[0].shape[0], -1)
    return rec, conv


def split_heads(rec: dict, conv: dict, size: int) -> list[tuple[dict, dict]]:
    """The whole state -> each of `size` ranks' (recurrent, conv) share."""
    out = []
    for r in range(size):
        mine_rec = {i: t.chunk(size)[r].contiguous() for i, t in rec.items()}
        mine_conv = {
            i: t.view(t.shape[0], 3, -1).chunk(size, -1)[r].reshape(t.shape[0], -1).contiguous()
            for i, t in conv.items()
        }
        out.append((mine_rec, mine_conv))
    return out
